//! GGUF v2/v3 reader.
//!
//! The parser works on a byte slice and never trusts a length or offset from
//! the file: every read is bounds-checked and every count is checked against
//! the bytes that remain, so a truncated or hostile file yields a
//! [`GgufError`] naming what is wrong instead of a panic or an out-of-bounds
//! read. [`GgufFile`] memory-maps a file and keeps the parsed index beside it.

mod parse;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub use parse::parse;

/// ggml tensor element types this engine can read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl GgmlType {
    /// Maps the on-disk ggml type id; `None` for types this engine does not support.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::BF16,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
            Self::BF16 => 30,
        }
    }

    /// The kernels' name for this type, which owns the block geometry.
    pub fn weight_type(self) -> kernels::WeightType {
        use kernels::WeightType as W;
        match self {
            Self::F32 => W::F32,
            Self::F16 => W::F16,
            Self::BF16 => W::BF16,
            Self::Q4_0 => W::Q4_0,
            Self::Q4_1 => W::Q4_1,
            Self::Q8_0 => W::Q8_0,
        }
    }

    /// Elements per quantization block (1 for plain float types).
    pub fn block_elems(self) -> usize {
        self.weight_type().block_elems()
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.weight_type().block_bytes()
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
        }
    }
}

/// A metadata value as stored in the file.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// Any integer type that fits in a u64 (negative values do not).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v),
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's entry in the file's index.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (innermost) dimension.
    pub dims: Vec<u64>,
    pub dtype: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    /// Byte length of the data.
    pub len: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> usize {
        // Checked at parse time not to overflow.
        self.dims.iter().product::<u64>() as usize
    }
}

/// The parsed header: version, metadata and tensor index.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    pub version: u32,
    pub alignment: usize,
    pub metadata: HashMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    pub data_offset: usize,
}

/// Everything that can be wrong with a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The first four bytes are not "GGUF".
    #[error("not a GGUF file (magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// A GGUF version this reader does not know.
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    /// The file ends before a field it declares.
    #[error("truncated file: needed {needed} bytes for {what} at offset {offset}, file has {len}")]
    Truncated { what: String, offset: usize, needed: usize, len: usize },
    /// A string is not valid UTF-8.
    #[error("invalid UTF-8 in {what} at offset {offset}")]
    InvalidUtf8 { what: String, offset: usize },
    /// An unknown metadata value type id.
    #[error("unknown metadata value type {type_id} for key {key:?}")]
    BadValueType { key: String, type_id: u32 },
    /// Arrays of arrays beyond the supported depth.
    #[error("metadata key {key:?}: arrays nested deeper than {max}")]
    NestingTooDeep { key: String, max: usize },
    /// A tensor uses a ggml type this engine cannot compute with.
    #[error("tensor {name:?} has unsupported ggml type id {type_id}")]
    UnsupportedTensorType { name: String, type_id: u32 },
    /// Shape is invalid: zero or too many dims, overflow, or not a whole number of blocks.
    #[error("tensor {name:?} has invalid shape {dims:?}: {why}")]
    BadShape { name: String, dims: Vec<u64>, why: &'static str },
    /// Tensor data lies outside the file or is misaligned.
    #[error(
        "tensor {name:?} data [{start}, {end}) is outside the data section [{data_start}, {file_len}) or misaligned"
    )]
    TensorOutOfBounds { name: String, start: u64, end: u64, data_start: usize, file_len: usize },
    /// Two tensors share a name.
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    /// `general.alignment` is zero or not a power of two.
    #[error("invalid general.alignment {0}")]
    BadAlignment(u64),
    /// A required metadata key is missing or has the wrong type.
    #[error("metadata key {key:?}: {why}")]
    Metadata { key: String, why: String },
    /// A required tensor is missing.
    #[error("missing tensor {0:?}")]
    MissingTensor(String),
}

/// A memory-mapped GGUF file with its parsed header.
pub struct GgufFile {
    path: PathBuf,
    map: crate::mmap::Mapped,
    pub header: GgufHeader,
    by_name: HashMap<String, usize>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let map = crate::mmap::Mapped::open(path).map_err(|source| GgufError::Io { path: path.to_owned(), source })?;
        let header = parse(map.bytes())?;
        let by_name = header.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(Self { path: path.to_owned(), map, header, by_name })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole file's bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.bytes()
    }

    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.header.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.header.tensors[i])
    }

    /// The raw bytes of a tensor (bounds were checked at parse time).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        &self.map.bytes()[info.offset..info.offset + info.len]
    }

    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor(name).ok_or_else(|| GgufError::MissingTensor(name.to_owned()))
    }

    pub fn require_str(&self, key: &str) -> Result<&str, GgufError> {
        self.meta(key).ok_or_else(|| missing(key))?.as_str().ok_or_else(|| wrong_type(key, "a string"))
    }

    pub fn require_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.meta(key).ok_or_else(|| missing(key))?.as_u64().ok_or_else(|| wrong_type(key, "a non-negative integer"))
    }

    pub fn require_f64(&self, key: &str) -> Result<f64, GgufError> {
        self.meta(key).ok_or_else(|| missing(key))?.as_f64().ok_or_else(|| wrong_type(key, "a number"))
    }

    /// A string-array key, e.g. `tokenizer.ggml.tokens`.
    pub fn str_array(&self, key: &str) -> Result<Vec<String>, GgufError> {
        let arr = self.meta(key).ok_or_else(|| missing(key))?.as_array().ok_or_else(|| wrong_type(key, "an array"))?;
        arr.iter()
            .map(|v| v.as_str().map(str::to_owned).ok_or_else(|| wrong_type(key, "an array of strings")))
            .collect()
    }

    /// An integer-array key, e.g. `tokenizer.ggml.token_type`.
    pub fn i64_array(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        let arr = self.meta(key).ok_or_else(|| missing(key))?.as_array().ok_or_else(|| wrong_type(key, "an array"))?;
        arr.iter().map(|v| v.as_i64().ok_or_else(|| wrong_type(key, "an array of integers"))).collect()
    }
}

fn missing(key: &str) -> GgufError {
    GgufError::Metadata { key: key.to_owned(), why: "missing".to_owned() }
}

fn wrong_type(key: &str, want: &str) -> GgufError {
    GgufError::Metadata { key: key.to_owned(), why: format!("expected {want}") }
}

#[cfg(test)]
pub(crate) mod tests;
