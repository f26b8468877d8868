"""The data: the corpora, their tokenizers, and the batches the trainer, fine-tuning and lm-eval read.

    dataloader        tokenizers and the training and evaluation streams (hub C4, local files, the embedded corpus)
    embedded_corpus   the embedded Jane Austen corpus and its tokenizer, built from the raw novels
    wikipedia_corpus  the Wikipedia corpus, built from its public source, and its tokenizer
    sft_data          instruction data for supervised fine-tuning
    lm_eval_tasks     lm-eval tasks built from the repository's own data, so that evaluation runs offline

Their documented commands are the entry points one level up (peft_pretraining/dataloader.py, wikipedia_corpus.py,
lm_eval_tasks.py), which run these modules' main.
"""
