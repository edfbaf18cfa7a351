//! `ncclConfig_t`: NCCL 2.28's layout (struct version 22800), read safely.
//!
//! Field list and order checked against NCCL's public header template
//! (github.com/NVIDIA/nccl, `src/nccl.h.in`, 2.28 series: `ncclConfig_v22800`).
//! Callers built against an older NCCL pass a smaller struct: we read only its
//! `size` bytes and treat the missing fields as undefined, as NCCL does.

use crate::errors::{CResult, Fail};
use std::ffi::{CStr, c_char, c_int, c_uint};

pub const API_MAGIC: c_uint = 0xcafe_beef;
pub const UNDEF_INT: c_int = c_int::MIN;
pub const SIM_INFO_MAGIC: c_uint = 0x7468_5283;

/// `ncclConfig_t` (v22800).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NcclConfig {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cga_cluster_size: c_int,
    pub min_ctas: c_int,
    pub max_ctas: c_int,
    pub net_name: *const c_char,
    pub split_share: c_int,
    pub traffic_class: c_int,
    pub comm_name: *const c_char,
    pub collnet_enable: c_int,
    pub cta_policy: c_int,
    pub shrink_share: c_int,
    pub nvls_ctas: c_int,
    pub n_channels_per_net_peer: c_int,
    pub nvlink_centric_sched: c_int,
}

/// The header every versioned NCCL struct starts with.
pub const HEADER_BYTES: usize = std::mem::size_of::<usize>() + 8;

impl NcclConfig {
    /// `NCCL_CONFIG_INITIALIZER`.
    pub fn initializer() -> NcclConfig {
        NcclConfig {
            size: std::mem::size_of::<NcclConfig>(),
            magic: API_MAGIC,
            version: libcomm::NCCL_COMPAT_VERSION as c_uint,
            blocking: UNDEF_INT,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: UNDEF_INT,
            traffic_class: UNDEF_INT,
            comm_name: std::ptr::null(),
            collnet_enable: UNDEF_INT,
            cta_policy: UNDEF_INT,
            shrink_share: UNDEF_INT,
            nvls_ctas: UNDEF_INT,
            n_channels_per_net_peer: UNDEF_INT,
            nvlink_centric_sched: UNDEF_INT,
        }
    }

    /// Reads a caller's config: only its first `size` bytes (older, smaller
    /// structs), the rest stays undefined. Refuses a struct that was not set
    /// up with `NCCL_CONFIG_INITIALIZER`.
    ///
    /// # Safety
    /// `p` must be NULL or point to at least `HEADER_BYTES` readable bytes and then `size` bytes.
    pub unsafe fn read(p: *const NcclConfig) -> CResult<Option<NcclConfig>> {
        if p.is_null() {
            return Ok(None);
        }
        let size = unsafe { std::ptr::read_unaligned(p.cast::<usize>()) };
        let magic = unsafe { std::ptr::read_unaligned(p.cast::<u8>().add(8).cast::<c_uint>()) };
        if magic != API_MAGIC {
            return Err(Fail::arg(format!(
                "config: magic is {magic:#x}, expected {API_MAGIC:#x}: initialise ncclConfig_t with NCCL_CONFIG_INITIALIZER"
            )));
        }
        if size < HEADER_BYTES {
            return Err(Fail::arg(format!(
                "config: size {size} is smaller than the ncclConfig_t header ({HEADER_BYTES} bytes): initialise it with NCCL_CONFIG_INITIALIZER"
            )));
        }
        let mut c = NcclConfig::initializer();
        let n = size.min(std::mem::size_of::<NcclConfig>());
        unsafe {
            std::ptr::copy_nonoverlapping(
                p.cast::<u8>(),
                (&mut c as *mut NcclConfig).cast::<u8>(),
                n,
            )
        };
        c.size = size;
        Ok(Some(c))
    }

    /// Checks the fields Weft interprets.
    pub fn validate(&self) -> CResult<()> {
        if self.blocking != UNDEF_INT && self.blocking != 0 && self.blocking != 1 {
            return Err(Fail::arg(format!(
                "config.blocking is {}, expected 0 or 1",
                self.blocking
            )));
        }
        for (name, v) in [
            ("cgaClusterSize", self.cga_cluster_size),
            ("minCTAs", self.min_ctas),
            ("maxCTAs", self.max_ctas),
            ("nvlsCTAs", self.nvls_ctas),
        ] {
            if v != UNDEF_INT && v < 0 {
                return Err(Fail::arg(format!(
                    "config.{name} is {v}, must not be negative"
                )));
            }
        }
        if self.min_ctas != UNDEF_INT && self.max_ctas != UNDEF_INT && self.min_ctas > self.max_ctas
        {
            return Err(Fail::arg(format!(
                "config.minCTAs ({}) is larger than maxCTAs ({})",
                self.min_ctas, self.max_ctas
            )));
        }
        Ok(())
    }

    pub fn comm_name(&self) -> Option<String> {
        if self.comm_name.is_null() {
            return None;
        }
        let s = unsafe { CStr::from_ptr(self.comm_name) };
        Some(s.to_string_lossy().into_owned())
    }
}

/// The libcomm configuration for a new communicator: `base` (the parent's,
/// or the environment's) with the caller's NCCL fields applied. Returns it and
/// whether it is blocking. GPU-only fields (CTAs, cluster size, netName,
/// collnet, splitShare, ...) are accepted and have no effect in host mode.
///
/// # Safety
/// `p` as for [`NcclConfig::read`].
pub unsafe fn resolve(
    p: *const NcclConfig,
    base: Option<&libcomm::Config>,
) -> CResult<(libcomm::Config, bool)> {
    let mut cfg = match base {
        Some(b) => b.clone(),
        None => libcomm::Config::from_env().map_err(Fail::from)?,
    };
    if let Some(c) = unsafe { NcclConfig::read(p)? } {
        c.validate()?;
        if c.blocking != UNDEF_INT {
            cfg.blocking = c.blocking != 0;
        }
        if let Some(n) = c.comm_name().filter(|n| !n.is_empty()) {
            cfg.name = Some(n);
        }
    }
    if base.is_some() && p.is_null() {
        // A child inherits the parent's settings, but not its name.
        cfg.name = None;
    }
    Ok((cfg.clone(), cfg.blocking))
}

/// `ncclSimInfo_t` (v22200).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SimInfo {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub estimated_time: f32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layout_is_ncclconfig_v22800() {
        assert_eq!(offset_of!(NcclConfig, blocking), 16);
        assert_eq!(offset_of!(NcclConfig, net_name), 32);
        assert_eq!(offset_of!(NcclConfig, split_share), 40);
        assert_eq!(offset_of!(NcclConfig, comm_name), 48);
        assert_eq!(offset_of!(NcclConfig, nvlink_centric_sched), 76);
        assert_eq!(size_of::<NcclConfig>(), 80);
        assert_eq!(size_of::<SimInfo>(), 24);
    }

    #[test]
    fn older_smaller_struct_is_accepted() {
        let mut c = NcclConfig::initializer();
        c.size = offset_of!(NcclConfig, net_name); // an old caller: up to maxCTAs
        c.blocking = 0;
        c.comm_name = c"ignored".as_ptr(); // beyond `size`: must not be read
        let r = unsafe { NcclConfig::read(&c) }.unwrap().unwrap();
        assert_eq!(r.blocking, 0);
        assert!(r.comm_name.is_null());
    }

    #[test]
    fn bad_magic_is_refused() {
        let mut c = NcclConfig::initializer();
        c.magic = 0;
        assert_eq!(unsafe { NcclConfig::read(&c) }.unwrap_err().code, 4);
    }
}
