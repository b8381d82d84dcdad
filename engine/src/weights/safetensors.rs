//! The safetensors container, read and written by hand.
//!
//! A file is an 8-byte little-endian header length `N`, `N` bytes of JSON
//! mapping each tensor name to `{"dtype", "shape", "data_offsets": [begin,
//! end]}` (offsets relative to the end of the header) plus an optional
//! `"__metadata__"` object of strings, then the tensor bytes.
//!
//! The format is small enough that a hand-written reader costs less than a
//! dependency, and it lets every check live in one place: [`parse_header`]
//! trusts nothing in the file. Every length and offset is bounds-checked and
//! every size is computed with checked arithmetic, so a truncated or hostile
//! file gives a [`SafetensorsError`] naming the tensor at fault, never a
//! panic or an out-of-bounds slice. Only the float types the kernels
//! multiply directly (F32, F16, BF16) are accepted; integer or 8-bit float
//! tensors are refused by name rather than misread.

use std::collections::BTreeMap;
use std::ops::Range;

use kernels::WeightType;
use serde_json::{Map, Value};

/// Headers larger than this are refused before they are parsed: real ones
/// are a few hundred KB, and the cap keeps a hostile length from making
/// serde_json work through gigabytes.
pub const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Element types this engine reads from safetensors files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    BF16,
}

impl Dtype {
    /// Parses the header's dtype string; `None` for types not supported here.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "F32" => Some(Self::F32),
            "F16" => Some(Self::F16),
            "BF16" => Some(Self::BF16),
            _ => None,
        }
    }

    /// The header's spelling of this type.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }

    /// The matmul kernels' name for this type.
    pub fn weight_type(self) -> WeightType {
        match self {
            Self::F32 => WeightType::F32,
            Self::F16 => WeightType::F16,
            Self::BF16 => WeightType::BF16,
        }
    }
}

/// Everything that can be wrong with a safetensors file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SafetensorsError {
    /// The file is shorter than the 8-byte header length.
    #[error("file of {len} bytes is too short for a safetensors header")]
    TooShort { len: usize },
    /// The header length points past the end of the file or over
    /// [`MAX_HEADER_BYTES`].
    #[error("header length {header_len} is impossible for a file of {file_len} bytes (cap {MAX_HEADER_BYTES})")]
    HeaderLength { header_len: u64, file_len: usize },
    /// The header is not a JSON object.
    #[error("header is not a JSON object: {0}")]
    HeaderJson(String),
    /// A tensor entry lacks a field, or a field has the wrong JSON type.
    #[error("tensor {tensor:?}: {why}")]
    BadEntry { tensor: String, why: String },
    /// A tensor's dtype is one this engine does not read (I64, F8_E4M3, ...).
    #[error("tensor {tensor:?} has unsupported dtype {dtype:?} (supported: F32, F16, BF16)")]
    UnsupportedDtype { tensor: String, dtype: String },
    /// The tensor's element count does not fit in memory arithmetic.
    #[error("tensor {tensor:?}: shape {shape:?} overflows")]
    ShapeOverflow { tensor: String, shape: Vec<u64> },
    /// `data_offsets` run backwards or past the end of the data section.
    #[error("tensor {tensor:?}: data_offsets [{begin}, {end}] outside the {data_len}-byte data section")]
    OutOfBounds { tensor: String, begin: u64, end: u64, data_len: usize },
    /// `data_offsets` span a different number of bytes than shape and dtype need.
    #[error("tensor {tensor:?}: {dtype:?} shape {shape:?} needs {expected} bytes, data_offsets span {found}")]
    SizeMismatch { tensor: String, dtype: Dtype, shape: Vec<usize>, expected: usize, found: u64 },
    /// `__metadata__` is not an object of strings.
    #[error("__metadata__ is not an object of strings")]
    BadMetadata,
}

/// One tensor's entry in the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: Dtype,
    /// Outermost first, as written (`[out_features, in_features]` for a linear layer).
    pub shape: Vec<usize>,
    /// The tensor's bytes as a range of the whole file (already offset by
    /// the header), checked to lie inside it.
    pub range: Range<usize>,
}

/// A parsed and validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
    /// The free-form `__metadata__` strings (e.g. `"format": "pt"`).
    pub metadata: BTreeMap<String, String>,
    /// Where the data section starts in the file.
    pub data_start: usize,
}

/// Parses and validates the header of a whole safetensors file held in
/// `file`. On success every [`TensorInfo::range`] may be sliced from `file`.
pub fn parse_header(file: &[u8]) -> Result<Header, SafetensorsError> {
    let len_bytes: [u8; 8] =
        file.get(..8).and_then(|b| b.try_into().ok()).ok_or(SafetensorsError::TooShort { len: file.len() })?;
    let header_len = u64::from_le_bytes(len_bytes);
    let bad_len = SafetensorsError::HeaderLength { header_len, file_len: file.len() };
    if header_len > MAX_HEADER_BYTES {
        return Err(bad_len);
    }
    // Cannot overflow: header_len is at most MAX_HEADER_BYTES.
    let data_start = 8 + header_len as usize;
    let json = file.get(8..data_start).ok_or(bad_len)?;
    let data_len = file.len() - data_start;

    let entries: Map<String, Value> =
        serde_json::from_slice(json).map_err(|e| SafetensorsError::HeaderJson(e.to_string()))?;
    let mut tensors = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    for (name, entry) in entries {
        if name == "__metadata__" {
            metadata = parse_metadata(entry)?;
            continue;
        }
        let info = parse_entry(&name, &entry, data_start, data_len)?;
        tensors.insert(name, info);
    }
    Ok(Header { tensors, metadata, data_start })
}

fn parse_metadata(entry: Value) -> Result<BTreeMap<String, String>, SafetensorsError> {
    let Value::Object(map) = entry else {
        return Err(SafetensorsError::BadMetadata);
    };
    map.into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k, s)),
            _ => Err(SafetensorsError::BadMetadata),
        })
        .collect()
}

fn parse_entry(name: &str, entry: &Value, data_start: usize, data_len: usize) -> Result<TensorInfo, SafetensorsError> {
    let bad = |why: &str| SafetensorsError::BadEntry { tensor: name.to_owned(), why: why.to_owned() };
    let dtype_str = entry.get("dtype").and_then(Value::as_str).ok_or_else(|| bad("no string \"dtype\""))?;
    let dtype = Dtype::parse(dtype_str)
        .ok_or_else(|| SafetensorsError::UnsupportedDtype { tensor: name.to_owned(), dtype: dtype_str.to_owned() })?;

    let shape_json = entry.get("shape").and_then(Value::as_array).ok_or_else(|| bad("no array \"shape\""))?;
    let shape_u64: Vec<u64> = shape_json
        .iter()
        .map(|d| d.as_u64().ok_or_else(|| bad("shape has an entry that is not a non-negative integer")))
        .collect::<Result<_, _>>()?;
    let overflow = || SafetensorsError::ShapeOverflow { tensor: name.to_owned(), shape: shape_u64.clone() };
    let shape: Vec<usize> =
        shape_u64.iter().map(|&d| usize::try_from(d).map_err(|_| overflow())).collect::<Result<_, _>>()?;
    let expected = shape.iter().try_fold(dtype.size(), |acc, &d| acc.checked_mul(d)).ok_or_else(overflow)?;

    let offsets =
        entry.get("data_offsets").and_then(Value::as_array).ok_or_else(|| bad("no array \"data_offsets\""))?;
    let (begin, end) = match offsets.as_slice() {
        [b, e] => (
            b.as_u64().ok_or_else(|| bad("data_offsets[0] is not a non-negative integer"))?,
            e.as_u64().ok_or_else(|| bad("data_offsets[1] is not a non-negative integer"))?,
        ),
        _ => return Err(bad("data_offsets is not [begin, end]")),
    };
    let out_of_bounds = || SafetensorsError::OutOfBounds { tensor: name.to_owned(), begin, end, data_len };
    if begin > end || end > data_len as u64 {
        return Err(out_of_bounds());
    }
    if end - begin != expected as u64 {
        return Err(SafetensorsError::SizeMismatch {
            tensor: name.to_owned(),
            dtype,
            shape,
            expected,
            found: end - begin,
        });
    }
    // Both offsets are <= data_len, so adding data_start stays within file.len().
    let range = data_start + begin as usize..data_start + end as usize;
    Ok(TensorInfo { dtype, shape, range })
}

/// A tensor to be written: [`encode_header`] lays them out in this order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// Bytes of data, or `None` if the size overflows.
    pub fn byte_len(&self) -> Option<usize> {
        self.shape.iter().try_fold(self.dtype.size(), |acc, &d| acc.checked_mul(d))
    }
}

/// The bytes that precede the data of a file holding `specs` back to back,
/// in order: the length prefix and the JSON header, padded with spaces so
/// that the data starts 8-byte aligned (as the reference writer does, which
/// lets readers that map the file view F32 data in place).
pub fn encode_header(specs: &[TensorSpec], metadata: &BTreeMap<String, String>) -> Result<Vec<u8>, SafetensorsError> {
    let mut entries = Map::new();
    if !metadata.is_empty() {
        let meta = metadata.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
        entries.insert("__metadata__".to_owned(), Value::Object(meta));
    }
    let mut offset = 0usize;
    for spec in specs {
        let overflow = || SafetensorsError::ShapeOverflow {
            tensor: spec.name.clone(),
            shape: spec.shape.iter().map(|&d| d as u64).collect(),
        };
        let end = spec.byte_len().and_then(|n| offset.checked_add(n)).ok_or_else(overflow)?;
        let entry = serde_json::json!({
            "dtype": spec.dtype.name(),
            "shape": spec.shape,
            "data_offsets": [offset, end],
        });
        entries.insert(spec.name.clone(), entry);
        offset = end;
    }
    let mut json = Value::Object(entries).to_string().into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A valid two-tensor file: `a` is F32 [2, 3], `b` is BF16 [4].
    fn sample() -> Vec<u8> {
        let specs = [
            TensorSpec { name: "a".into(), dtype: Dtype::F32, shape: vec![2, 3] },
            TensorSpec { name: "b".into(), dtype: Dtype::BF16, shape: vec![4] },
        ];
        let meta = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
        let mut f = encode_header(&specs, &meta).unwrap_or_default();
        f.extend((0..32u8).map(|i| i.wrapping_mul(7)));
        f
    }

    /// A file whose header is `json`, followed by `data_len` zero bytes.
    fn with_header(json: &str, data_len: usize) -> Vec<u8> {
        let mut f = (json.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(json.as_bytes());
        f.resize(f.len() + data_len, 0);
        f
    }

    #[test]
    fn round_trips_a_written_header() -> Result<(), SafetensorsError> {
        let f = sample();
        let h = parse_header(&f)?;
        assert_eq!(h.data_start % 8, 0, "data is 8-byte aligned");
        assert_eq!(h.metadata.get("format").map(String::as_str), Some("pt"));
        let a = &h.tensors["a"];
        assert_eq!(
            (a.dtype, a.shape.as_slice(), a.range.clone()),
            (Dtype::F32, &[2, 3][..], h.data_start..h.data_start + 24)
        );
        let b = &h.tensors["b"];
        assert_eq!((b.dtype, b.range.clone()), (Dtype::BF16, h.data_start + 24..h.data_start + 32));
        Ok(())
    }

    #[test]
    fn refuses_bad_lengths() {
        assert_eq!(parse_header(&[1, 2, 3]), Err(SafetensorsError::TooShort { len: 3 }));
        let mut f = sample();
        let len = f.len() as u64;
        f[..8].copy_from_slice(&len.to_le_bytes());
        assert!(matches!(parse_header(&f), Err(SafetensorsError::HeaderLength { .. })));
        f[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(parse_header(&f), Err(SafetensorsError::HeaderLength { .. })));
        let f = with_header("[1, 2]", 0);
        assert!(matches!(parse_header(&f), Err(SafetensorsError::HeaderJson(_))));
    }

    #[test]
    fn unsupported_dtype_names_tensor_and_dtype() {
        let f = with_header(r#"{"ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}"#, 16);
        assert_eq!(
            parse_header(&f),
            Err(SafetensorsError::UnsupportedDtype { tensor: "ids".into(), dtype: "I64".into() })
        );
    }

    #[test]
    fn offsets_and_sizes_are_checked() {
        let case = |entry: &str, data_len: usize| parse_header(&with_header(&format!(r#"{{"t": {entry}}}"#), data_len));
        assert!(matches!(
            case(r#"{"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}"#, 4),
            Err(SafetensorsError::OutOfBounds { .. })
        ));
        assert!(matches!(
            case(r#"{"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}"#, 8),
            Err(SafetensorsError::OutOfBounds { .. })
        ));
        assert!(matches!(
            case(r#"{"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}"#, 8),
            Err(SafetensorsError::SizeMismatch { expected: 12, found: 8, .. })
        ));
        assert!(matches!(
            case(r#"{"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}"#, 8),
            Err(SafetensorsError::ShapeOverflow { .. })
        ));
        assert!(matches!(
            case(r#"{"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}"#, 8),
            Err(SafetensorsError::BadEntry { .. })
        ));
        assert!(matches!(
            case(r#"{"dtype": "F32", "shape": [2], "data_offsets": [0]}"#, 8),
            Err(SafetensorsError::BadEntry { .. })
        ));
        assert!(matches!(case(r#"{"shape": [2], "data_offsets": [0, 8]}"#, 8), Err(SafetensorsError::BadEntry { .. })));
        // A scalar (empty shape) holds one element.
        assert!(case(r#"{"dtype": "F16", "shape": [], "data_offsets": [6, 8]}"#, 8).is_ok());
        let meta = with_header(r#"{"__metadata__": {"format": 3}}"#, 0);
        assert_eq!(parse_header(&meta), Err(SafetensorsError::BadMetadata));
    }

    /// A deterministic stand-in for a fuzz target that runs in every test
    /// run: thousands of random mutations and truncations of a valid file
    /// must each parse or fail with an error, never panic, and whatever
    /// parses must be sliceable.
    #[test]
    fn random_mutations_never_panic() {
        let base = sample();
        let mut rng = types::rng::XorShift64::new(0x2545_F491_4F6C_DD1D);
        let mut next = || rng.next_u64();
        let mut parsed = 0;
        for _ in 0..20_000 {
            let mut f = base.clone();
            for _ in 0..(next() % 4 + 1) {
                let i = (next() as usize) % f.len();
                // Half the time a printable byte, so mutations of the JSON
                // often stay JSON and reach the field checks.
                f[i] = if next() % 2 == 0 { b" 0123456789[],:{}\"-eE."[(next() % 22) as usize] } else { next() as u8 };
            }
            if next() % 8 == 0 {
                let cut = (next() as usize) % f.len();
                f.truncate(cut);
            }
            if let Ok(h) = parse_header(&f) {
                parsed += 1;
                for t in h.tensors.values() {
                    assert!(f.get(t.range.clone()).is_some());
                }
            }
        }
        assert!(parsed > 0, "no mutation survived: the fuzz loop only tests the first check");
    }
}
