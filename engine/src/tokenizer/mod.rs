//! Tokenizer and chat template (filled in by the tokenizer work).
