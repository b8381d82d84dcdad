//! Token sampling (filled in by the sampler work).
