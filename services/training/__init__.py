"""`strata model train-demo`: train Strata's default model on the Python standard library.

    stdlib .py files -> fixed split (corpus) -> byte-level BPE (bpe) -> token ids
      -> small qwen3_moe MoE in plain torch (moe) -> AdamW loop (loop)
      -> held-out loss, unigram baseline, routing statistics (evaluate)
      -> Hugging Face checkpoint + model card (export)

Entry point: services.training.cli.main(argv) -> int.
"""
