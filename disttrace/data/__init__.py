"""The embedded data: a generated corpus, a byte-level BPE tokenizer trained on it, token windows per rank."""
