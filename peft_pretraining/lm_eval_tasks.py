"""`python -m peft_pretraining.lm_eval_tasks --output_dir DIR`, the documented command (docs/analyses.md): writes the
offline lm-eval tasks. Only an entry point: the code is peft_pretraining/data/lm_eval_tasks.py."""

if __name__ == "__main__":
    from peft_pretraining.data.lm_eval_tasks import main

    main()
