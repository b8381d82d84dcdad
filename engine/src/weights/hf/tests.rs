//! HF checkpoints on tiny synthetic models: names, the Q/K row order
//! (against llama.cpp's formula and against RoPE itself), loading single
//! files and shards, exporting, and refusing malformed checkpoints.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::*;
use crate::weights::export::{export_safetensors, ExportDtype};
use crate::weights::safetensors::{encode_header, Dtype, TensorSpec};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Deterministic test data: the workspace's seeded xorshift.
use types::rng::XorShift64 as Rng;

/// A scratch directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> std::io::Result<Self> {
        let dir = std::env::temp_dir().join(format!("tandem-hf-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tiny_config(tied: bool) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 32,
        "vocab_size": 10,
        "tie_word_embeddings": tied,
    })
}

/// One HF tensor of a synthetic checkpoint.
struct Tensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// Random tensors for `cfg` under HF names, cycling through the three float types.
fn tiny_tensors(cfg: &LlamaConfig) -> Vec<Tensor> {
    let mut rng = Rng::new(0x1234_5678_9ABC_DEF1);
    let dtypes = [Dtype::F32, Dtype::BF16, Dtype::F16];
    llama_tensors(cfg)
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let dtype = dtypes[i % 3];
            let n: usize = shape.iter().product();
            let mut data = Vec::with_capacity(n * dtype.size());
            for _ in 0..n {
                let v = rng.f32_signed();
                match dtype {
                    Dtype::F32 => data.extend_from_slice(&v.to_le_bytes()),
                    Dtype::BF16 => data.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes()),
                    Dtype::F16 => data.extend_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes()),
                }
            }
            Tensor { name: hf_name(&name).unwrap_or(name), dtype, shape, data }
        })
        .collect()
}

fn write_safetensors(path: &Path, tensors: &[&Tensor]) -> TestResult {
    let specs: Vec<TensorSpec> =
        tensors.iter().map(|t| TensorSpec { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() }).collect();
    let mut bytes = encode_header(&specs, &BTreeMap::new())?;
    for t in tensors {
        bytes.extend_from_slice(&t.data);
    }
    std::fs::write(path, bytes)?;
    Ok(())
}

/// A checkpoint directory with `config` and `tensors` in one model.safetensors.
fn write_checkpoint(dir: &Path, config: &Value, tensors: &[&Tensor]) -> TestResult {
    std::fs::write(dir.join("config.json"), config.to_string())?;
    write_safetensors(&dir.join("model.safetensors"), tensors)
}

/// A byte-level BPE with three control tokens, the 256 bytes and no merges.
fn tiny_tokenizer() -> Result<crate::tokenizer::Tokenizer, crate::tokenizer::TokenizerError> {
    use crate::tokenizer::{Tokenizer, TokenizerParts, TOKEN_TYPE_CONTROL};
    // GPT-2's byte -> printable character map, in byte order.
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(String::from).to_vec();
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or('?')
        };
        tokens.push(c.to_string());
    }
    let mut token_types = vec![TOKEN_TYPE_CONTROL; 3];
    token_types.resize(tokens.len(), 1);
    Tokenizer::from_parts(TokenizerParts {
        model: "gpt2".into(),
        pre: "smollm".into(),
        tokens,
        token_types,
        merges: Vec::new(),
        bos_id: Some(1),
        eos_id: Some(2),
        eot_id: None,
        add_bos: false,
        chat_template: Some("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}".into()),
    })
}

fn values(w: &Weights, name: &str) -> Result<Vec<f32>, WeightsError> {
    let t = w.get(name)?;
    let mut out = vec![0f32; t.dims.iter().product()];
    kernels::quant::dequantize_row(t.ty, w.bytes(t), &mut out);
    Ok(out)
}

#[test]
fn names_map_both_ways() -> TestResult {
    let cfg = config_from_json(tiny_config(false).to_string().as_bytes())?;
    for (name, _) in llama_tensors(&cfg) {
        let hf = hf_name(&name).ok_or("no HF name")?;
        assert_eq!(gguf_name(&hf).as_deref(), Some(name.as_str()), "{hf}");
    }
    assert_eq!(gguf_name("model.layers.12.self_attn.o_proj.weight").as_deref(), Some("blk.12.attn_output.weight"));
    assert_eq!(gguf_name("lm_head.weight").as_deref(), Some("output.weight"));
    for odd in [
        "model.layers.+1.mlp.up_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers..mlp.up_proj.weight",
        "model.rotary.weight",
    ] {
        assert_eq!(gguf_name(odd), None, "{odd}");
    }
    Ok(())
}

/// The permutation is exactly llama.cpp's
/// `w.reshape(n_head, 2, hd/2, cols).swapaxes(1, 2).reshape(rows, cols)`,
/// written here as index arithmetic on the 4-D view.
#[test]
fn permutation_matches_llama_cpp_reshape() -> TestResult {
    let (n_head, hd, cols) = (3, 8, 5);
    let rows = n_head * hd;
    let hf: Vec<u8> = (0..rows * cols).map(|i| i as u8).collect();
    let mut expected = vec![0u8; hf.len()];
    for h in 0..n_head {
        for i in 0..hd / 2 {
            for j in 0..2 {
                for c in 0..cols {
                    // out[h][i][j][c] = in[h][j][i][c]
                    expected[((h * (hd / 2) + i) * 2 + j) * cols + c] = hf[((h * 2 + j) * (hd / 2) + i) * cols + c];
                }
            }
        }
    }
    assert_eq!(permute_qk(&hf, rows, n_head, QkOrder::HfToGguf)?, expected);
    Ok(())
}

#[test]
fn permutation_round_trips() -> TestResult {
    let mut rng = Rng::new(7);
    for (rows, n_head, row_bytes) in [(12, 3, 6), (64, 1, 4), (576, 9, 2), (192, 3, 20)] {
        let m: Vec<u8> = (0..rows * row_bytes).map(|_| rng.next_u64() as u8).collect();
        let gguf = permute_qk(&m, rows, n_head, QkOrder::HfToGguf)?;
        assert_ne!(gguf, m);
        assert_eq!(permute_qk(&gguf, rows, n_head, QkOrder::GgufToHf)?, m);
        for r in 0..rows {
            assert_eq!(gguf_row_of_hf(hf_row_of_gguf(r, rows / n_head), rows / n_head), r);
        }
    }
    assert!(matches!(permute_qk(&[0; 18], 6, 2, QkOrder::HfToGguf), Err(CheckpointError::BadQkShape { .. })));
    assert!(matches!(permute_qk(&[0; 7], 2, 1, QkOrder::HfToGguf), Err(CheckpointError::BadQkShape { .. })));
    Ok(())
}

/// What the permutation is for: transformers' `rotate_half` RoPE on HF rows
/// gives the same rotated values as the engine's adjacent-pair RoPE on GGUF
/// rows, element for element under the row map.
#[test]
fn rope_layouts_agree() -> TestResult {
    let (n_head, hd, cols, theta) = (2, 8, 6, 10_000f32);
    let rows = n_head * hd;
    let mut rng = Rng::new(99);
    let w_gguf: Vec<f32> = (0..rows * cols).map(|_| rng.f32_signed()).collect();
    let x: Vec<f32> = (0..cols).map(|_| rng.f32_signed()).collect();
    let bytes: Vec<u8> = w_gguf.iter().flat_map(|v| v.to_le_bytes()).collect();
    let hf_bytes = permute_qk(&bytes, rows, n_head, QkOrder::GgufToHf)?;
    let w_hf: Vec<f32> = hf_bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let matvec =
        |w: &[f32]| -> Vec<f32> { w.chunks_exact(cols).map(|r| r.iter().zip(&x).map(|(a, b)| a * b).sum()).collect() };

    let pos = 5;
    let mut q_gguf = matvec(&w_gguf);
    kernels::ops::RopeTable::new(hd, hd, theta, 8).apply(&mut q_gguf, pos);
    // transformers: q * cos + rotate_half(q) * sin, with cos/sin repeated over both halves.
    let q = matvec(&w_hf);
    let mut q_hf = q.clone();
    let half = hd / 2;
    for h in 0..n_head {
        for i in 0..half {
            let a = pos as f64 * (theta as f64).powf(-(2.0 * i as f64) / hd as f64);
            let (c, s) = (a.cos() as f32, a.sin() as f32);
            let (lo, hi) = (h * hd + i, h * hd + i + half);
            q_hf[lo] = q[lo] * c - q[hi] * s;
            q_hf[hi] = q[hi] * c + q[lo] * s;
        }
    }
    for r in 0..rows {
        let (g, h) = (q_gguf[r], q_hf[hf_row_of_gguf(r, hd)]);
        assert!((g - h).abs() < 1e-5, "row {r}: {g} vs {h}");
    }
    Ok(())
}

#[test]
fn loads_a_checkpoint_and_reorders_qk() -> TestResult {
    let dir = TempDir::new("single")?;
    let config = tiny_config(false);
    let cfg = config_from_json(config.to_string().as_bytes())?;
    let tensors = tiny_tensors(&cfg);
    write_checkpoint(&dir.0, &config, &tensors.iter().collect::<Vec<_>>())?;
    let w = Weights::from_safetensors(&dir.0)?;
    assert_eq!(w.config, cfg);
    assert_eq!((cfg.rope_theta, cfg.rms_eps, cfg.head_dim), (10_000.0, 1e-5, 4));
    assert_eq!(w.tensors.len(), tensors.len());
    for t in &tensors {
        let name = gguf_name(&t.name).ok_or("unmapped")?;
        let loaded = w.get(&name)?;
        assert_eq!((loaded.ty, &loaded.dims), (t.dtype.weight_type(), &t.shape));
        let want = match rope_heads(&name, &cfg) {
            Some(n_head) => permute_qk(&t.data, t.shape[0], n_head, QkOrder::HfToGguf)?,
            None => t.data.clone(),
        };
        assert_eq!(w.bytes(loaded), want, "{name}");
    }
    // The engine runs it.
    crate::model::Model::new(w, 1)?;
    Ok(())
}

#[test]
fn loads_shards_like_a_single_file() -> TestResult {
    let dir = TempDir::new("shards")?;
    let config = tiny_config(true);
    let cfg = config_from_json(config.to_string().as_bytes())?;
    let tensors = tiny_tensors(&cfg);
    let (first, second) = tensors.split_at(tensors.len() / 2);
    write_safetensors(&dir.0.join("a.safetensors"), &first.iter().collect::<Vec<_>>())?;
    write_safetensors(&dir.0.join("b.safetensors"), &second.iter().collect::<Vec<_>>())?;
    let map: serde_json::Map<String, Value> = first
        .iter()
        .map(|t| (t.name.clone(), json!("a.safetensors")))
        .chain(second.iter().map(|t| (t.name.clone(), json!("b.safetensors"))))
        .collect();
    std::fs::write(dir.0.join("model.safetensors.index.json"), json!({"weight_map": map}).to_string())?;
    std::fs::write(dir.0.join("config.json"), config.to_string())?;
    let sharded = Weights::from_safetensors(&dir.0)?;

    let single_dir = TempDir::new("unsharded")?;
    write_checkpoint(&single_dir.0, &config, &tensors.iter().collect::<Vec<_>>())?;
    let single = Weights::from_safetensors(&single_dir.0)?;
    assert!(sharded.config.tied_embeddings && sharded.get("output.weight").is_err());
    for name in single.tensors.keys() {
        assert_eq!(sharded.bytes(sharded.get(name)?), single.bytes(single.get(name)?), "{name}");
    }

    std::fs::write(
        dir.0.join("model.safetensors.index.json"),
        json!({"weight_map": {"x": "../a.safetensors"}}).to_string(),
    )?;
    let err = Weights::from_safetensors(&dir.0).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("not a file name"), "{err}");
    Ok(())
}

#[test]
fn export_then_load_gives_the_same_weights() -> TestResult {
    for tied in [false, true] {
        let src = TempDir::new(&format!("export-src-{tied}"))?;
        let config = tiny_config(tied);
        let cfg = config_from_json(config.to_string().as_bytes())?;
        let tensors = tiny_tensors(&cfg);
        write_checkpoint(&src.0, &config, &tensors.iter().collect::<Vec<_>>())?;
        let w = Weights::from_safetensors(&src.0)?;
        let tok = tiny_tokenizer()?;
        for dtype in [ExportDtype::F32, ExportDtype::BF16] {
            let out = TempDir::new(&format!("export-out-{tied}-{dtype:?}"))?;
            export_safetensors(&w, &tok, &out.0, dtype)?;
            let mut files: Vec<String> =
                std::fs::read_dir(&out.0)?.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
            files.sort();
            assert_eq!(
                files,
                [
                    "config.json",
                    "generation_config.json",
                    "model.safetensors",
                    "tokenizer.json",
                    "tokenizer_config.json"
                ]
            );
            let back = Weights::from_safetensors(&out.0)?;
            assert_eq!(back.config, w.config);
            let file = std::fs::read(out.0.join("model.safetensors"))?;
            let header = parse_header(&file)?;
            assert_eq!(header.tensors.contains_key("lm_head.weight"), !tied);
            assert!(header.tensors.values().all(|t| t.dtype == Dtype::from(dtype)));
            for name in w.tensors.keys() {
                // The tiny tensors are bf16- or f16-exact only in part, so BF16 export rounds.
                let (a, b) = (values(&w, name)?, values(&back, name)?);
                let tol = if dtype == ExportDtype::F32 { 0.0 } else { 1.0 / 128.0 };
                assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= tol * x.abs()), "{name}");
            }
        }
    }
    Ok(())
}

#[test]
fn config_errors_name_the_problem() {
    let with = |edit: &dyn Fn(&mut Value)| {
        let mut c = tiny_config(false);
        edit(&mut c);
        config_from_json(c.to_string().as_bytes())
    };
    assert!(matches!(
        with(&|c| {
            c["architectures"] = json!(["MistralForCausalLM"]);
            c["model_type"] = json!("mistral");
        }),
        Err(CheckpointError::UnsupportedArchitecture { .. })
    ));
    // model_type alone is enough.
    assert!(with(&|c| c["architectures"] = Value::Null).is_ok());
    assert_eq!(
        with(&|c| {
            c.as_object_mut().map(|o| o.remove("hidden_size"));
        }),
        Err(CheckpointError::ConfigKey { key: "hidden_size", why: "missing".into() })
    );
    assert!(matches!(
        with(&|c| c["vocab_size"] = json!("10")),
        Err(CheckpointError::ConfigKey { key: "vocab_size", .. })
    ));
    assert!(matches!(
        with(&|c| c["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0})),
        Err(CheckpointError::UnsupportedFeature { key: "rope_scaling", .. })
    ));
    assert!(matches!(
        with(&|c| c["attention_bias"] = json!(true)),
        Err(CheckpointError::UnsupportedFeature { key: "attention_bias", .. })
    ));
    assert!(matches!(
        with(&|c| c["head_dim"] = json!(8)),
        Err(CheckpointError::UnsupportedFeature { key: "head_dim", .. })
    ));
    assert!(matches!(with(&|c| c["num_key_value_heads"] = json!(3)), Err(CheckpointError::InvalidConfig(_))));
    assert!(matches!(config_from_json(b"[]"), Err(CheckpointError::ConfigJson(_))));
    // Defaults: kv heads = heads, theta 10000, untied.
    let c = with(&|c| {
        for k in ["num_key_value_heads", "tie_word_embeddings", "rms_norm_eps"] {
            c.as_object_mut().map(|o| o.remove(k));
        }
    });
    assert_eq!(c.map(|c| (c.n_kv_heads, c.rope_theta, c.rms_eps, c.tied_embeddings)), Ok((2, 10_000.0, 1e-6, false)));
}

#[test]
fn tensor_errors_name_the_tensor() -> TestResult {
    let config = tiny_config(false);
    let cfg = config_from_json(config.to_string().as_bytes())?;
    let tensors = tiny_tensors(&cfg);
    let dir = TempDir::new("bad-tensors")?;

    let mut extra = tiny_tensors(&cfg);
    extra[0].name = "model.layers.9.mlp.up_proj.weight".into();
    write_checkpoint(&dir.0, &config, &extra.iter().chain(&tensors[1..]).collect::<Vec<_>>())?;
    let err = Weights::from_safetensors(&dir.0).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("unexpected tensor \"model.layers.9.mlp.up_proj.weight\""), "{err}");

    let last = tensors.len() - 1;
    write_checkpoint(&dir.0, &config, &tensors[..last].iter().collect::<Vec<_>>())?;
    assert!(matches!(Weights::from_safetensors(&dir.0), Err(WeightsError::Missing(n)) if n == tensors[last].name));

    let mut wrong = tiny_tensors(&cfg);
    wrong[0].shape = vec![wrong[0].shape[1], wrong[0].shape[0]];
    write_checkpoint(&dir.0, &config, &wrong.iter().collect::<Vec<_>>())?;
    assert!(matches!(Weights::from_safetensors(&dir.0), Err(WeightsError::Shape { .. })));

    std::fs::remove_file(dir.0.join("model.safetensors"))?;
    assert!(matches!(Weights::from_safetensors(&dir.0), Err(WeightsError::Io { .. })));
    Ok(())
}
