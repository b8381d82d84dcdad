//! Registered memory that peers write into with one-sided puts.

use std::ffi::c_void;
use std::rc::Rc;

use crate::raw::{self, ucs_status_t};
use crate::{check, Context, Error, Result};

impl Context {
    /// Allocates and registers `len` bytes (zeroed) that peers may write into
    /// with the region's packed key.
    pub fn map(self: &Rc<Self>, len: usize) -> Result<Region> {
        if len == 0 {
            return Err(Error::new("ucp_mem_map", ucs_status_t::UCS_ERR_INVALID_PARAM));
        }
        let params = raw::ucp_mem_map_params_t {
            field_mask: (raw::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | raw::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | raw::UCP_MEM_MAP_PARAM_FIELD_FLAGS) as u64,
            address: std::ptr::null_mut(),
            length: len,
            flags: raw::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let mut memh: raw::ucp_mem_h = std::ptr::null_mut();
        // SAFETY: the context is alive (self); params ask UCX to allocate the memory itself.
        check("ucp_mem_map", unsafe { raw::ucp_mem_map(self.h, &params, &mut memh) })?;
        let mut attr = raw::ucp_mem_attr_t {
            field_mask: (raw::UCP_MEM_ATTR_FIELD_ADDRESS | raw::UCP_MEM_ATTR_FIELD_LENGTH) as u64,
            ..Default::default()
        };
        // SAFETY: memh was just returned by ucp_mem_map.
        let queried = check("ucp_mem_query", unsafe { raw::ucp_mem_query(memh, &mut attr) });
        if let Err(e) = queried.and_then(|()| {
            if attr.address.is_null() || attr.length < len {
                Err(Error::new("ucp_mem_query", ucs_status_t::UCS_ERR_NO_MEMORY))
            } else {
                Ok(())
            }
        }) {
            // SAFETY: memh is ours and unmapped once, on this error path only.
            unsafe { raw::ucp_mem_unmap(self.h, memh) };
            return Err(e);
        }
        let region = Region { ctx: self.clone(), memh, base: attr.address.cast::<u8>(), len };
        region.write(0, &vec![0; len]).map_err(|_| Error::new("ucp_mem_map", ucs_status_t::UCS_ERR_NO_MEMORY))?;
        Ok(region)
    }
}

/// A byte range outside a [`Region`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("range {offset}+{len} is outside the {size}-byte region")]
pub struct OutOfRange {
    pub offset: usize,
    pub len: usize,
    pub size: usize,
}

/// Registered memory, allocated by UCX, that peers write into with one-sided
/// puts. Local code never holds a Rust reference into it (a peer's write may
/// land at any time): it copies in and out with [`Region::read`] and
/// [`Region::write`]. Dropping it unregisters it and frees the memory.
/// Where the NIC checks keys (RDMA), a later put with its key then fails;
/// where UCX emulates puts (tcp), the worker that exposed the region writes
/// arriving puts itself, during progress, at the address the key named
/// without checking it: destroy that worker before dropping its regions.
pub struct Region {
    ctx: Rc<Context>,
    memh: raw::ucp_mem_h,
    base: *mut u8,
    len: usize,
}

impl Region {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address a peer puts to for offset 0 (remote address = this + offset).
    pub fn remote_base(&self) -> u64 {
        self.base as u64
    }

    /// The key a peer unpacks ([`Endpoint::unpack_key`](crate::Endpoint::unpack_key)) to write here.
    pub fn pack_key(&self) -> Result<Vec<u8>> {
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: context and memh are alive; buf/size are out pointers.
        check("ucp_rkey_pack", unsafe { raw::ucp_rkey_pack(self.ctx.h, self.memh, &mut buf, &mut size) })?;
        // SAFETY: UCX returned `size` readable bytes at buf; copied, then released once.
        let key = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) }.to_vec();
        // SAFETY: buf came from ucp_rkey_pack.
        unsafe { raw::ucp_rkey_buffer_release(buf) };
        Ok(key)
    }

    fn range(&self, offset: usize, len: usize) -> std::result::Result<(), OutOfRange> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(OutOfRange { offset, len, size: self.len }),
        }
    }

    /// Where the region's `len` bytes at `offset` are, for a caller that
    /// copies them out with its own loop. Valid while the region lives; a
    /// peer may write those bytes at any time, so never form a reference
    /// to them (copy out with raw reads, as [`Region::read`] does).
    pub fn ptr(&self, offset: usize, len: usize) -> std::result::Result<*const u8, OutOfRange> {
        self.range(offset, len)?;
        Ok(self.base.wrapping_add(offset).cast_const())
    }

    /// Copies `out.len()` bytes at `offset` out of the region.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> std::result::Result<(), OutOfRange> {
        self.range(offset, out.len())?;
        // SAFETY: the range is inside the allocation (checked); `out` is a distinct Rust
        // buffer. A peer's concurrent put into the same bytes is a protocol error the
        // caller's checksum detects, not a Rust reference being aliased: no reference
        // into the region is ever created.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `data` into the region at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> std::result::Result<(), OutOfRange> {
        self.range(offset, data.len())?;
        // SAFETY: as in read, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.base.add(offset), data.len()) };
        Ok(())
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: memh is ours; after this no key packed from it is valid, which is the point.
        unsafe { raw::ucp_mem_unmap(self.ctx.h, self.memh) };
    }
}
