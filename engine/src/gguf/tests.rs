use super::*;

/// Builds small GGUF files for tests (and fuzz seeds).
pub(crate) struct Builder {
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl Builder {
    pub fn new() -> Self {
        Self { kv: Vec::new(), n_kv: 0, tensors: Vec::new() }
    }
    fn key(&mut self, k: &str, ty: u32) {
        self.kv.extend((k.len() as u64).to_le_bytes());
        self.kv.extend(k.as_bytes());
        self.kv.extend(ty.to_le_bytes());
        self.n_kv += 1;
    }
    pub fn u32(mut self, k: &str, v: u32) -> Self {
        self.key(k, 4);
        self.kv.extend(v.to_le_bytes());
        self
    }
    pub fn str(mut self, k: &str, v: &str) -> Self {
        self.key(k, 8);
        self.kv.extend((v.len() as u64).to_le_bytes());
        self.kv.extend(v.as_bytes());
        self
    }
    pub fn str_array(mut self, k: &str, v: &[&str]) -> Self {
        self.key(k, 9);
        self.kv.extend(8u32.to_le_bytes());
        self.kv.extend((v.len() as u64).to_le_bytes());
        for s in v {
            self.kv.extend((s.len() as u64).to_le_bytes());
            self.kv.extend(s.as_bytes());
        }
        self
    }
    pub fn tensor(mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> Self {
        self.tensors.push((name.to_owned(), dims.to_vec(), ty.id(), data));
        self
    }
    pub fn build(self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            out.extend((name.len() as u64).to_le_bytes());
            out.extend(name.as_bytes());
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        while out.len() % 32 != 0 {
            out.push(0);
        }
        for (_, _, _, data) in &self.tensors {
            out.extend(data);
            while out.len() % 32 != 0 {
                out.push(0);
            }
        }
        out
    }
}

fn sample() -> Vec<u8> {
    Builder::new()
        .str("general.architecture", "llama")
        .u32("llama.block_count", 2)
        .str_array("tokenizer.ggml.tokens", &["a", "b", "ü"])
        .tensor("w", &[32, 2], GgmlType::Q8_0, vec![7u8; 68])
        .tensor("v", &[4], GgmlType::F32, vec![1u8; 16])
        .build()
}

#[test]
fn parses_a_built_file() {
    let h = parse(&sample()).expect("valid file");
    assert_eq!(h.version, 3);
    assert_eq!(h.metadata["general.architecture"].as_str(), Some("llama"));
    assert_eq!(h.metadata["llama.block_count"].as_u64(), Some(2));
    assert_eq!(h.tensors.len(), 2);
    assert_eq!(h.tensors[0].len, 68);
    assert_eq!(h.tensors[1].offset - h.tensors[0].offset, 96);
}

#[test]
fn every_truncation_is_a_typed_error() {
    let full = sample();
    for cut in 0..full.len() - 1 {
        // The last tensor's padding is not data, so only cuts into real bytes must fail.
        if cut >= full.len() - 16 {
            break;
        }
        assert!(parse(&full[..cut]).is_err(), "cut at {cut} parsed");
    }
}

#[test]
fn bad_magic_and_version() {
    let mut f = sample();
    f[0] = b'X';
    assert!(matches!(parse(&f), Err(GgufError::BadMagic(_))));
    let mut f = sample();
    f[4] = 9;
    assert!(matches!(parse(&f), Err(GgufError::UnsupportedVersion(9))));
}

#[test]
fn huge_counts_do_not_allocate() {
    let mut f = b"GGUF".to_vec();
    f.extend(3u32.to_le_bytes());
    f.extend(u64::MAX.to_le_bytes());
    f.extend(0u64.to_le_bytes());
    assert!(matches!(parse(&f), Err(GgufError::Truncated { .. })));
}

#[test]
fn tensor_outside_file_is_refused() {
    let f = Builder::new().tensor("w", &[32, 1000], GgmlType::Q8_0, vec![0u8; 34]).build();
    assert!(matches!(parse(&f), Err(GgufError::TensorOutOfBounds { .. })));
}

#[test]
fn unknown_tensor_type_and_bad_shape() {
    let mut f = Builder::new().tensor("w", &[32], GgmlType::F32, vec![0u8; 128]).build();
    // type id sits right after name + n_dims + dims
    let pos = 24 + 8 + 1 + 4 + 8;
    f[pos] = 77;
    assert!(matches!(parse(&f), Err(GgufError::UnsupportedTensorType { type_id: 77, .. })));
    let f = Builder::new().tensor("w", &[31], GgmlType::Q4_1, vec![0u8; 20]).build();
    assert!(matches!(parse(&f), Err(GgufError::BadShape { .. })));
}

/// A deterministic stand-in for the fuzz target that runs in every test run:
/// thousands of random single- and multi-byte mutations of a valid file must
/// each parse or fail with an error, never panic.
#[test]
fn random_mutations_never_panic() {
    let base = sample();
    let mut rng = types::rng::XorShift64::new(0x9E37_79B9_7F4A_7C15);
    let mut next = || rng.next_u64();
    for _ in 0..20_000 {
        let mut f = base.clone();
        for _ in 0..(next() % 4 + 1) {
            let i = (next() as usize) % f.len();
            f[i] = next() as u8;
        }
        if next() % 8 == 0 {
            let cut = (next() as usize) % f.len();
            f.truncate(cut);
        }
        let _ = parse(&f);
    }
}
