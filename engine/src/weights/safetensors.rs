//! HF safetensors weights (filled in by the safetensors work).
