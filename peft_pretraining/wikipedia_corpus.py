"""`python -m peft_pretraining.wikipedia_corpus build-corpus|build-tokenizer`, the documented command (docs/data.md):
builds the Wikipedia corpus from its public source, or its tokenizer. Only an entry point: the code is
peft_pretraining/data/wikipedia_corpus.py."""

if __name__ == "__main__":
    from peft_pretraining.data.wikipedia_corpus import main

    main()
