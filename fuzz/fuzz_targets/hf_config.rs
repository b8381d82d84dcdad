//! Fuzzes the Hugging Face config.json reader with arbitrary bytes.
//!
//! An accepted config must pass the same shape checks a GGUF config does,
//! since the forward pass indexes with these numbers.

#![no_main]

use engine::weights::hf::config_from_json;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(cfg) = config_from_json(data) {
        if let Err(why) = cfg.validate() {
            panic!("accepted config fails validate: {why}: {cfg:?}");
        }
        assert_eq!(cfg.n_heads * cfg.head_dim, cfg.hidden, "heads x head_dim != hidden: {cfg:?}");
        assert!(cfg.kv_dim() <= cfg.hidden, "kv_dim above hidden: {cfg:?}");
        assert!(cfg.rope_dims <= cfg.head_dim, "rope dims above head_dim: {cfg:?}");
    }
});
