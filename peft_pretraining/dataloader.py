"""`python -m peft_pretraining.dataloader build-embedded --source DIR`, the documented command (docs/data.md): rebuilds
the embedded corpus and its tokenizer. Only an entry point: the code is peft_pretraining/data/embedded_corpus.py, and
the data pipeline peft_pretraining/data/dataloader.py."""

if __name__ == "__main__":
    from peft_pretraining.data.embedded_corpus import main

    main()
