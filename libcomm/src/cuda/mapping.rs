//! The peer-visible area of each rank and its mapping by the others.
//!
//! Phase 1 ([`DevComm::create`]) allocates this rank's area (flags, two
//! scratch halves, lines, LL) and the host-mapped status word, and describes
//! it in a descriptor of [`DESCRIPTOR_BYTES`] for the peers. The caller
//! all-gathers the descriptors; phase 2 ([`DevComm::connect`]) maps every
//! peer's area: CUDA P2P for ranks in this process, CUDA IPC for ranks in
//! other processes of the host. [`DevComm::finalize`] releases it all.
//!
//! **Host identity is a boundary.** A peer whose host identity differs from
//! this rank's is never mapped, even where the driver could (two simulated
//! hosts on one machine, `WEFT_HOSTNAME` per half): [`peer_link`] says
//! which way a peer is reached, and "another host" fails the connect. The
//! backend sends communicators that span hosts to the cross-host path
//! (`proxy.rs`) before they get here; this check keeps any other way in
//! honest.
//!
//! Descriptor layout (little-endian): 0..8 process token, 8..12 device
//! ordinal, 16..24 area base, 24..32 scratch bytes per parity, 32 IPC handle
//! valid, 40..52 PCI domain/bus/device, 52..56 SM count, 56..64 host
//! identity, 64..128 the IPC handle.
//!
//! **Ranks sharing a GPU in one process.** Their kernels run in one CUDA
//! context, concurrently, and spin on each other: every block of every rank's
//! kernel must be resident at once, or a resident block waits for ever on a
//! block that cannot start until it ends (4 ranks of 128 blocks on one H100
//! hung; 2 fitted). Ranks in other processes are time-sliced instead (each
//! context gets the whole GPU in turn). So where ranks share a GPU in one
//! process, every rank caps its kernels' blocks ([`residency_cap`]) from
//! the gathered descriptors, alike everywhere; where even one block per rank
//! would not fit, the kernel path is off (staging through host memory).

use super::abi::{FLAG_AREA, LINES_AREA, LL_AREA, MAX_BLOCKS, MAX_RANKS, Status};
use super::devcomm::{DevComm, stall_site};
use super::driver::{
    compute_capability, device_at, nvlink_class, pci_location, sm_count, use_device,
};
use super::error::{CudaError, CudaResult, check};
use super::ll::LlHistory;
use super::tuning::Tuning;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

/// Bytes of one rank's descriptor in the init exchange.
pub const DESCRIPTOR_BYTES: usize = 128;

/// A random token naming this process (pids repeat across containers).
fn process_token() -> u64 {
    static T: OnceLock<u64> = OnceLock::new();
    *T.get_or_init(|| {
        let mut b = [0u8; 8];
        let _ = getrandom::fill(&mut b);
        u64::from_le_bytes(b) ^ std::process::id() as u64
    })
}

impl DevComm {
    /// Phase 1: allocates this rank's area on `dev` and describes it for the
    /// peers (`DESCRIPTOR_BYTES`).
    /// `host`: this rank's host identity (the bootstrap's).
    pub fn create(
        rank: usize,
        nranks: usize,
        dev: i32,
        host: u64,
    ) -> CudaResult<(DevComm, Vec<u8>)> {
        let ctx = use_device(dev)?;
        let _ = ctx;
        let cc = compute_capability(dev)?;
        let tuning = Tuning::from_env();
        let parity_bytes = tuning.parity_bytes;
        let total = FLAG_AREA + 2 * parity_bytes + LINES_AREA + LL_AREA;
        let mut base: sys::CUdeviceptr = 0;
        let mut status: *mut c_void = std::ptr::null_mut();
        unsafe {
            check(
                sys::cuMemHostAlloc(
                    &mut status,
                    std::mem::size_of::<Status>(),
                    sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
                ),
                "cuMemHostAlloc (the communicator's abort word)",
            )?;
            std::ptr::write_bytes(status.cast::<u8>(), 0, std::mem::size_of::<Status>());
            if let Err(e) = check(sys::cuMemAlloc_v2(&mut base, total), "cuMemAlloc") {
                let _ = sys::cuMemFreeHost(status);
                return Err(e.context(format!(
                    "{} MiB of scratch on GPU {dev}; WEFT_CUDA_SCRATCH_MB sets it",
                    total >> 20
                )));
            }
            check(sys::cuMemsetD8_v2(base, 0, FLAG_AREA), "cuMemsetD8")?;
            // No line may carry a valid flag before a lines chain wrote it.
            let lines = base + (FLAG_AREA + 2 * parity_bytes) as u64;
            check(sys::cuMemsetD8_v2(lines, 0, LINES_AREA), "cuMemsetD8")?;
            // Nor an LL line before an LL operation wrote it (flags start at 1).
            let ll = lines + LINES_AREA as u64;
            check(sys::cuMemsetD8_v2(ll, 0, LL_AREA), "cuMemsetD8")?;
            check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
        }
        let mut d = vec![0u8; DESCRIPTOR_BYTES];
        d[0..8].copy_from_slice(&process_token().to_le_bytes());
        d[8..12].copy_from_slice(&dev.to_le_bytes());
        d[16..24].copy_from_slice(&base.to_le_bytes());
        d[24..32].copy_from_slice(&(parity_bytes as u64).to_le_bytes());
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        let ipc_ok = unsafe { sys::cuIpcGetMemHandle(&mut h, base) } == sys::CUresult::CUDA_SUCCESS;
        d[32] = ipc_ok as u8;
        for (i, v) in pci_location(dev)?.iter().enumerate() {
            d[40 + 4 * i..44 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        d[52..56].copy_from_slice(&sm_count(dev)?.to_le_bytes());
        d[56..64].copy_from_slice(&host.to_le_bytes());
        for (i, c) in h.reserved.iter().enumerate() {
            d[64 + i] = *c as u8;
        }
        Ok((
            DevComm {
                rank,
                nranks,
                dev,
                host,
                cc,
                base,
                parity_bytes,
                peers: vec![0; nranks],
                seq: 0,
                usable: false,
                direct: false,
                lines_capable: false,
                lines: false,
                status: status.cast(),
                word: crate::op::backend::AbortWord::new(status.cast()),
                tuning,
                ll: LlHistory::default(),
                send_seq: vec![0; nranks],
                recv_seq: vec![0; nranks],
                recv_blocks: vec![0; nranks],
                imported: Vec::new(),
                peer_devs: Vec::new(),
                eager: None,
                eager_off: false,
            },
            d,
        ))
    }

    /// Phase 2: maps every peer's area from the gathered descriptors
    /// (`nranks * DESCRIPTOR_BYTES`). Ok(false): some peer cannot be mapped
    /// (the reason is returned for the log); the kernel path must then be off
    /// on every rank, which the caller agrees on with the peers.
    pub fn connect(&mut self, all: &[u8]) -> CudaResult<()> {
        if self.nranks > MAX_RANKS {
            return Err(CudaError::Unsupported(format!(
                "{} ranks: the kernel path supports at most {MAX_RANKS}",
                self.nranks
            )));
        }
        let ctx = use_device(self.dev)?;
        let _ = ctx;
        let me = process_token();
        let (colocated, sms) = colocation(all, self.nranks);
        match residency_cap(colocated, sms, self.nranks) {
            Ok(None) => {}
            Ok(Some(cap)) => self.tuning.cap_blocks(cap),
            Err(why) => return Err(CudaError::Unsupported(why)),
        }
        self.direct = self.tuning.allow_direct
            && (0..self.nranks)
                .all(|r| all[r * DESCRIPTOR_BYTES..r * DESCRIPTOR_BYTES + 8] == me.to_le_bytes());
        for r in 0..self.nranks {
            let d = &all[r * DESCRIPTOR_BYTES..(r + 1) * DESCRIPTOR_BYTES];
            let dev = i32::from_le_bytes(d[8..12].try_into().unwrap());
            let base = u64::from_le_bytes(d[16..24].try_into().unwrap());
            let pb = u64::from_le_bytes(d[24..32].try_into().unwrap()) as usize;
            if pb != self.parity_bytes {
                return Err(CudaError::InvalidUsage(format!(
                    "rank {r} has {pb} bytes of scratch per parity, this rank {} (set WEFT_CUDA_SCRATCH_MB alike everywhere)",
                    self.parity_bytes
                )));
            }
            if r == self.rank {
                self.peers[r] = self.base;
                continue;
            }
            let link = peer_link(me, self.host, d);
            if link == PeerLink::OtherHost {
                return Err(CudaError::Unsupported(format!(
                    "rank {r} is on another host (its host identity differs: WEFT_HOSTNAME, or hostname, boot id and network namespace); ranks of different hosts never map each other's memory"
                )));
            }
            if link == PeerLink::SameProcess {
                if dev != self.dev {
                    let peer_ctx = use_device(dev)?;
                    use_device(self.dev)?;
                    let (mut a, mut pd) = (0i32, 0);
                    unsafe {
                        let mut md = 0;
                        check(sys::cuDeviceGet(&mut md, self.dev), "cuDeviceGet")?;
                        check(sys::cuDeviceGet(&mut pd, dev), "cuDeviceGet")?;
                        check(
                            sys::cuDeviceCanAccessPeer(&mut a, md, pd),
                            "cuDeviceCanAccessPeer",
                        )?;
                        if a == 0 {
                            return Err(CudaError::Unsupported(format!(
                                "GPU {} cannot access GPU {dev} directly (no P2P)",
                                self.dev
                            )));
                        }
                        let r = sys::cuCtxEnablePeerAccess(peer_ctx, 0);
                        if r != sys::CUresult::CUDA_SUCCESS
                            && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                        {
                            check(r, "cuCtxEnablePeerAccess")?;
                        }
                    }
                }
                if dev != self.dev && !self.peer_devs.contains(&dev) {
                    self.peer_devs.push(dev);
                }
                self.peers[r] = base;
            } else {
                if d[32] == 0 {
                    return Err(CudaError::Unsupported(format!(
                        "rank {r} could not export its scratch (cuIpcGetMemHandle)"
                    )));
                }
                let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
                for i in 0..64 {
                    h.reserved[i] = d[64 + i] as _;
                }
                let mut p: sys::CUdeviceptr = 0;
                unsafe {
                    check(
                        sys::cuIpcOpenMemHandle_v2(&mut p, h, 1),
                        "cuIpcOpenMemHandle (CUDA IPC to a rank in another process)",
                    )?
                };
                self.peers[r] = p;
                self.imported.push(p);
            }
        }
        self.lines_capable = self.cc.0 >= 8
            && (0..self.nranks).filter(|&r| r != self.rank).all(|r| {
                let d = &all[r * DESCRIPTOR_BYTES..(r + 1) * DESCRIPTOR_BYTES];
                let word = |i: usize| i32::from_le_bytes(d[i..i + 4].try_into().unwrap());
                let peer = if d[0..8] == me.to_le_bytes() {
                    Some(word(8))
                } else {
                    device_at([word(40), word(44), word(48)])
                };
                peer.is_some_and(|p| nvlink_class(self.dev, p))
            });
        // Stalled waits (WEFT_TIMEOUT_MS) are named from the peers' areas.
        let (rank, nranks, peers, pb) = (
            self.rank,
            self.nranks,
            self.peers.clone(),
            self.parity_bytes,
        );
        // SAFETY: `status` is live until finalize retires the word.
        let (timeout_ms, stalled) = unsafe {
            (
                &raw mut (*self.status).timeout_ms,
                &raw const (*self.status).stalled,
            )
        };
        self.word.watch_stalls(
            timeout_ms,
            stalled,
            Box::new(move |a| stall_site(a, rank, nranks, &peers, pb)),
        );
        Ok(())
    }

    /// Releases the device side after the communicator's last operation:
    /// waits for this rank's device, closes the peers' IPC mappings and frees
    /// this rank's area. Ranks in other processes are past the exit barrier of
    /// every kernel that touched it once this device is idle; ranks of this
    /// process read each other's areas without one, so their areas are freed
    /// together when the last of them finalizes. Not after an abort (a kernel
    /// of a peer may still be spinning on our flags): that memory is left to
    /// the process's end.
    pub fn finalize(mut self) -> CudaResult<()> {
        use_device(self.dev)?;
        // Every stream of the context, the side stream of eager sends too.
        unsafe { check(sys::cuCtxSynchronize(), "cuCtxSynchronize")? };
        if let Some(mut e) = self.eager.take() {
            e.destroy();
        }
        // The status word is freed below (or by the last rank of this
        // process): nothing may write it from now on.
        self.word.retire();
        for p in &self.imported {
            unsafe { check(sys::cuIpcCloseMemHandle(*p), "cuIpcCloseMemHandle")? };
        }
        if !self.direct {
            unsafe {
                check(sys::cuMemFree_v2(self.base), "cuMemFree")?;
                check(sys::cuMemFreeHost(self.status.cast()), "cuMemFreeHost")?;
            }
            return Ok(());
        }
        // Same process: free when every rank of the group has finalized.
        type Retired = HashMap<u64, Vec<(i32, u64, usize)>>;
        static RETIRED: Mutex<Option<Retired>> = Mutex::new(None);
        let done = {
            let mut g = RETIRED.lock().unwrap_or_else(|e| e.into_inner());
            let m = g.get_or_insert_with(HashMap::new);
            let key = self.peers[0];
            let v = m.entry(key).or_default();
            v.push((self.dev, self.base, self.status as usize));
            if v.len() == self.nranks {
                m.remove(&key)
            } else {
                None
            }
        };
        for (dev, base, status) in done.unwrap_or_default() {
            use_device(dev)?;
            unsafe {
                check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
                check(sys::cuMemFree_v2(base), "cuMemFree")?;
                check(sys::cuMemFreeHost(status as *mut c_void), "cuMemFreeHost")?;
            }
        }
        Ok(())
    }
}

/// How this rank reaches a peer, from the peer's descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PeerLink {
    /// A rank of this process: CUDA P2P (or the same GPU).
    SameProcess,
    /// Another process of this host: CUDA IPC.
    OtherProcess,
    /// Another host identity: never mapped (the cross-host path).
    OtherHost,
}

/// `token` and `host`: this process's token and this rank's host identity.
/// Host identity comes first: a process token never spans hosts, but two
/// identities in one process (threads given different names) are still
/// two hosts.
pub(super) fn peer_link(token: u64, host: u64, desc: &[u8]) -> PeerLink {
    let word = |i: usize| u64::from_le_bytes(desc[i..i + 8].try_into().unwrap());
    if word(56) != host {
        PeerLink::OtherHost
    } else if word(0) == token {
        PeerLink::SameProcess
    } else {
        PeerLink::OtherProcess
    }
}

/// From the gathered descriptors: the most ranks that share one GPU in one
/// process (same process token and device), and the fewest SMs of any
/// rank's GPU (the cap must be the same on every rank).
fn colocation(all: &[u8], nranks: usize) -> (usize, usize) {
    let desc = |r: usize| &all[r * DESCRIPTOR_BYTES..(r + 1) * DESCRIPTOR_BYTES];
    let mut most = 0;
    let mut sms = usize::MAX;
    for r in 0..nranks {
        let d = desc(r);
        let same = (0..nranks).filter(|&q| desc(q)[0..12] == d[0..12]).count();
        most = most.max(same);
        let n = i32::from_le_bytes(d[52..56].try_into().unwrap());
        sms = sms.min(n.max(0) as usize);
    }
    (most, sms)
}

/// Blocks each kernel of a communicator may use when up to `colocated` of
/// its ranks share a GPU of `sms` SMs in one process (see the module docs).
/// Every SM holds at least one block of any of our kernels (they are built
/// for 512 threads per block), so the kernels are all resident if their
/// blocks together are at most `sms`. A rank may have a collective or a
/// point-to-point round on its stream and an eager send round on its side
/// stream at once; a round adds up to one block per send (n - 1) besides
/// the capped receives, and the eager round up to n - 1 more. So each rank
/// keeps `sms / colocated - 2 (n - 1)` for the capped part.
///
/// `Ok(None)`: no cap (one rank per GPU per process). `Err`: not even one
/// block per kernel fits (the kernel path is then off: staging).
pub(super) fn residency_cap(
    colocated: usize,
    sms: usize,
    nranks: usize,
) -> Result<Option<usize>, String> {
    if colocated <= 1 {
        return Ok(None);
    }
    let per_rank = sms / colocated;
    let spare = 2 * nranks.saturating_sub(1);
    if per_rank <= spare {
        return Err(format!(
            "{colocated} ranks of this communicator share one GPU in one process, and their kernels must all be resident at once: {sms} SMs leave {per_rank} blocks per rank, and {} are needed; use fewer ranks per GPU (or one process per rank)",
            spare + 1
        ));
    }
    Ok(Some((per_rank - spare).min(MAX_BLOCKS)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descs(ranks: &[(u64, i32, i32)]) -> Vec<u8> {
        let mut all = vec![0u8; ranks.len() * DESCRIPTOR_BYTES];
        for (r, &(token, dev, sms)) in ranks.iter().enumerate() {
            let d = &mut all[r * DESCRIPTOR_BYTES..(r + 1) * DESCRIPTOR_BYTES];
            d[0..8].copy_from_slice(&token.to_le_bytes());
            d[8..12].copy_from_slice(&dev.to_le_bytes());
            d[52..56].copy_from_slice(&sms.to_le_bytes());
        }
        all
    }

    #[test]
    fn ranks_sharing_a_gpu_in_one_process_are_counted() {
        // One process, 4 ranks on GPU 0 (ncclCommInitAll over [0, 0, 0, 0]).
        assert_eq!(colocation(&descs(&[(7, 0, 132); 4]), 4), (4, 132));
        // One process, 2 GPUs, 2 ranks each; the smallest GPU counts.
        let two = descs(&[(7, 0, 132), (7, 1, 108), (7, 0, 132), (7, 1, 108)]);
        assert_eq!(colocation(&two, 4), (2, 108));
        // One rank per process, all on GPU 0: time-sliced, nothing shared.
        assert_eq!(
            colocation(&descs(&[(1, 0, 132), (2, 0, 132), (3, 0, 132)]), 3).0,
            1
        );
        // Two processes, two ranks of the first on one GPU.
        assert_eq!(
            colocation(&descs(&[(1, 0, 132), (1, 0, 132), (2, 0, 132)]), 3).0,
            2
        );
    }

    #[test]
    fn a_peer_with_another_host_identity_is_never_mapped() {
        let desc = |token: u64, host: u64| {
            let mut d = vec![0u8; DESCRIPTOR_BYTES];
            d[0..8].copy_from_slice(&token.to_le_bytes());
            d[56..64].copy_from_slice(&host.to_le_bytes());
            d
        };
        let (me, host) = (7, 0xaa);
        assert_eq!(peer_link(me, host, &desc(7, 0xaa)), PeerLink::SameProcess);
        assert_eq!(peer_link(me, host, &desc(8, 0xaa)), PeerLink::OtherProcess);
        // Two simulated hosts on one machine (WEFT_HOSTNAME per half): CUDA
        // IPC would work, and must not be used.
        assert_eq!(peer_link(me, host, &desc(8, 0xbb)), PeerLink::OtherHost);
        // Even in one process: another identity is another host.
        assert_eq!(peer_link(me, host, &desc(7, 0xbb)), PeerLink::OtherHost);
    }

    #[test]
    fn the_cap_lets_every_colocated_kernel_be_resident() {
        assert_eq!(
            residency_cap(1, 132, 8),
            Ok(None),
            "one rank per GPU: no cap"
        );
        // The hang of the issue: 4 ranks on one H100 (132 SMs).
        for (k, n) in [(2usize, 2usize), (3, 3), (4, 4), (8, 8), (4, 8)] {
            let cap = residency_cap(k, 132, n).unwrap().unwrap();
            assert!((1..=MAX_BLOCKS).contains(&cap));
            // Each rank: a capped kernel plus the uncapped sends of a round
            // and of an eager round; all ranks together fit the SMs.
            assert!(k * (cap + 2 * (n - 1)) <= 132, "{k} ranks of {n}: {cap}");
        }
        assert_eq!(residency_cap(4, 132, 4), Ok(Some(27)));
        // Too small a GPU for that many ranks: refused (staging).
        let e = residency_cap(8, 40, 8).unwrap_err();
        assert!(e.contains("8 ranks") && e.contains("resident"), "{e}");
    }
}
