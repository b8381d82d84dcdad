//! Bounds-checked GGUF header parser over a byte slice.

use std::collections::{HashMap, HashSet};

use super::{GgmlType, GgufError, GgufHeader, MetaValue, TensorInfo};

/// Arrays may contain arrays, but not without limit: a hostile file could
/// otherwise recurse the parser off the stack.
const MAX_ARRAY_DEPTH: usize = 4;
const MAX_DIMS: u32 = 4;

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => {
                Err(GgufError::Truncated { what: what.to_owned(), offset: self.pos, needed: n, len: self.bytes.len() })
            }
        }
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.array::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.array::<8>(what).map(u64::from_le_bytes)
    }

    /// A length-prefixed string; the length is checked against what remains
    /// before anything is allocated.
    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let len = usize::try_from(len).ok().filter(|&l| l <= self.remaining()).ok_or_else(|| GgufError::Truncated {
            what: what.to_owned(),
            offset: self.pos,
            needed: usize::try_from(len).unwrap_or(usize::MAX),
            len: self.bytes.len(),
        })?;
        let start = self.pos;
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| GgufError::InvalidUtf8 { what: what.to_owned(), offset: start })
    }

    /// A count of items, each at least `min_item_bytes` long: a count that
    /// cannot fit in the rest of the file is a truncation, found before any
    /// allocation of that size.
    fn count(&mut self, what: &str, min_item_bytes: usize) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        let fits = usize::try_from(n).ok().filter(|&n| n.saturating_mul(min_item_bytes.max(1)) <= self.remaining());
        fits.ok_or_else(|| GgufError::Truncated {
            what: format!("{what} ({n} items)"),
            offset: self.pos,
            needed: usize::try_from(n).unwrap_or(usize::MAX).saturating_mul(min_item_bytes.max(1)),
            len: self.bytes.len(),
        })
    }

    fn value(&mut self, key: &str, type_id: u32, depth: usize) -> Result<MetaValue, GgufError> {
        Ok(match type_id {
            0 => MetaValue::U8(self.array::<1>(key)?[0]),
            1 => MetaValue::I8(i8::from_le_bytes(self.array::<1>(key)?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array::<2>(key)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array::<2>(key)?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.array::<4>(key)?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.array::<4>(key)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array::<4>(key)?)),
            7 => MetaValue::Bool(self.array::<1>(key)?[0] != 0),
            8 => MetaValue::Str(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::NestingTooDeep { key: key.to_owned(), max: MAX_ARRAY_DEPTH });
                }
                let elem_type = self.u32(key)?;
                let min = match elem_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    other => return Err(GgufError::BadValueType { key: key.to_owned(), type_id: other }),
                };
                let n = self.count(key, min)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(key, elem_type, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(u64::from_le_bytes(self.array::<8>(key)?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.array::<8>(key)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array::<8>(key)?)),
            other => return Err(GgufError::BadValueType { key: key.to_owned(), type_id: other }),
        })
    }
}

/// Parses a GGUF header and tensor index from the whole file's bytes and
/// checks that every tensor's data lies inside the file.
pub fn parse(bytes: &[u8]) -> Result<GgufHeader, GgufError> {
    let mut r = Reader { bytes, pos: 0 };
    let magic = r.array::<4>("magic")?;
    if &magic != b"GGUF" {
        return Err(GgufError::BadMagic(magic));
    }
    let version = r.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    // Each tensor info is at least 8 (name len) + 4 (n_dims) + 4 (type) + 8 (offset) bytes;
    // each key/value at least 8 + 4 + 1.
    let n_tensors = r.count("tensor count", 24)?;
    let n_kv = r.count("metadata count", 13)?;

    let mut metadata = HashMap::with_capacity(n_kv);
    for _ in 0..n_kv {
        let key = r.string("metadata key")?;
        let type_id = r.u32(&key)?;
        let value = r.value(&key, type_id, 0)?;
        metadata.insert(key, value);
    }

    let alignment = match metadata.get("general.alignment") {
        None => 32,
        Some(v) => {
            let a = v.as_u64().ok_or(GgufError::BadAlignment(0))?;
            if a == 0 || !a.is_power_of_two() || a > 1 << 20 {
                return Err(GgufError::BadAlignment(a));
            }
            a as usize
        }
    };

    let mut raw = Vec::with_capacity(n_tensors);
    let mut names = HashSet::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = r.string("tensor name")?;
        let n_dims = r.u32(&name)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError::BadShape { name, dims: vec![], why: "number of dimensions must be 1..=4" });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(r.u64(&name)?);
        }
        let type_id = r.u32(&name)?;
        let offset = r.u64(&name)?;
        if !names.insert(name.clone()) {
            return Err(GgufError::DuplicateTensor(name));
        }
        raw.push((name, dims, type_id, offset));
    }

    let data_offset = r.pos.div_ceil(alignment).saturating_mul(alignment);
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, dims, type_id, offset) in raw {
        let dtype = GgmlType::from_id(type_id)
            .ok_or_else(|| GgufError::UnsupportedTensorType { name: name.clone(), type_id })?;
        let n = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).filter(|&n| n > 0 && n < (1 << 40));
        let Some(n) = n else {
            return Err(GgufError::BadShape { name, dims, why: "element count is zero or overflows" });
        };
        let block = dtype.block_elems() as u64;
        if dims[0] % block != 0 {
            return Err(GgufError::BadShape {
                name,
                dims,
                why: "row length is not a whole number of quantization blocks",
            });
        }
        let len = n / block * dtype.block_bytes() as u64;
        let start = (data_offset as u64).checked_add(offset);
        let end = start.and_then(|s| s.checked_add(len));
        match (start, end) {
            (Some(s), Some(e)) if e <= bytes.len() as u64 && offset % alignment as u64 == 0 => {
                tensors.push(TensorInfo { name, dims, dtype, offset: s as usize, len: len as usize });
            }
            _ => {
                return Err(GgufError::TensorOutOfBounds {
                    name,
                    start: start.unwrap_or(u64::MAX),
                    end: end.unwrap_or(u64::MAX),
                    data_start: data_offset,
                    file_len: bytes.len(),
                })
            }
        }
    }

    Ok(GgufHeader { version, alignment, metadata, tensors, data_offset })
}
