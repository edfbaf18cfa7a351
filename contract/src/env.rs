//! The environment contract: what the operator puts into a pod ([`PodEnv`]),
//! what a launcher (`weft run`, or a pod's ranks) gives one rank process
//! ([`RankEnv`]), and what the rank side reads back ([`RankId`],
//! [`BootstrapEnv`]).
//!
//! The names are a contract with the data plane (libcomm reads the `WEFT_*`
//! ones), with PyTorch (`RANK`, `MASTER_ADDR`, ...) and torchrun (`PET_*`):
//! the operator and `weft run` build them from these structs, so a program
//! behaves the same under `weft run` and in a cluster.

use crate::params::{self, Lookup, Param, ParamError};
use std::fmt;

/// The names of the contract, as constants.
pub mod names {
    use crate::params;

    pub const WEFT_JOB: &str = params::WEFT_JOB.name();
    pub const WEFT_JOB_NAMESPACE: &str = params::WEFT_JOB_NAMESPACE.name();
    pub const WEFT_RANK: &str = params::WEFT_RANK.name();
    pub const WEFT_LOCAL_RANK: &str = params::WEFT_LOCAL_RANK.name();
    pub const WEFT_WORLD_SIZE: &str = params::WEFT_WORLD_SIZE.name();
    pub const WEFT_LOCAL_RANKS: &str = params::WEFT_LOCAL_RANKS.name();
    pub const WEFT_RANK_OFFSET: &str = params::WEFT_RANK_OFFSET.name();
    pub const WEFT_NNODES: &str = params::WEFT_NNODES.name();
    pub const WEFT_NODE_RANK: &str = params::WEFT_NODE_RANK.name();
    pub const WEFT_BOOTSTRAP: &str = params::WEFT_BOOTSTRAP.name();
    pub const NCCL_COMM_ID: &str = params::NCCL_COMM_ID.name();
    pub const WEFT_SIDECAR_SOCKET: &str = params::WEFT_SIDECAR_SOCKET.name();
    pub const WEFT_JOB_SECRET: &str = params::WEFT_JOB_SECRET.name();
    pub const WEFT_JOB_SECRET_FILE: &str = params::WEFT_JOB_SECRET_FILE.name();
    pub const WEFT_RESTART_EPOCH: &str = params::WEFT_RESTART_EPOCH.name();
    pub const WEFT_INCARNATION: &str = params::WEFT_INCARNATION.name();
    pub const WEFT_RECOVERY_DIR: &str = params::WEFT_RECOVERY_DIR.name();
    pub const WEFT_TRANSPORT: &str = params::WEFT_TRANSPORT.name();
    pub const WEFT_NET_IF: &str = params::WEFT_NET_IF.name();
    pub const WEFT_LOG: &str = params::WEFT_LOG.name();
    pub const OTEL_EXPORTER_OTLP_ENDPOINT: &str = params::OTEL_EXPORTER_OTLP_ENDPOINT.name();
    // PyTorch (set for the program; Weft reads RANK and WORLD_SIZE as fallbacks).
    pub const RANK: &str = params::RANK.name();
    pub const WORLD_SIZE: &str = params::WORLD_SIZE.name();
    pub const LOCAL_RANK: &str = "LOCAL_RANK";
    pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
    pub const MASTER_ADDR: &str = "MASTER_ADDR";
    pub const MASTER_PORT: &str = "MASTER_PORT";
    // torchrun (set for the program; Weft reads none of them).
    pub const PET_NNODES: &str = "PET_NNODES";
    pub const PET_NODE_RANK: &str = "PET_NODE_RANK";
    pub const PET_NPROC_PER_NODE: &str = "PET_NPROC_PER_NODE";
    pub const PET_MASTER_ADDR: &str = "PET_MASTER_ADDR";
    pub const PET_MASTER_PORT: &str = "PET_MASTER_PORT";

    /// Every name above.
    pub const ALL: &[&str] = &[
        WEFT_JOB,
        WEFT_JOB_NAMESPACE,
        WEFT_RANK,
        WEFT_LOCAL_RANK,
        WEFT_WORLD_SIZE,
        WEFT_LOCAL_RANKS,
        WEFT_RANK_OFFSET,
        WEFT_NNODES,
        WEFT_NODE_RANK,
        WEFT_BOOTSTRAP,
        NCCL_COMM_ID,
        WEFT_SIDECAR_SOCKET,
        WEFT_JOB_SECRET,
        WEFT_JOB_SECRET_FILE,
        WEFT_RESTART_EPOCH,
        WEFT_INCARNATION,
        WEFT_RECOVERY_DIR,
        WEFT_TRANSPORT,
        WEFT_NET_IF,
        WEFT_LOG,
        OTEL_EXPORTER_OTLP_ENDPOINT,
        RANK,
        WORLD_SIZE,
        LOCAL_RANK,
        LOCAL_WORLD_SIZE,
        MASTER_ADDR,
        MASTER_PORT,
        PET_NNODES,
        PET_NODE_RANK,
        PET_NPROC_PER_NODE,
        PET_MASTER_ADDR,
        PET_MASTER_PORT,
    ];
}

use names::*;

/// A variable list, in the order it is set.
pub type Vars = Vec<(&'static str, String)>;

/// Why the environment does not fulfil the contract.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnvError {
    /// A required variable (or each of its alternatives) is unset.
    Missing {
        name: &'static str,
        or: Option<&'static str>,
    },
    /// A variable does not parse.
    Bad(ParamError),
}

impl fmt::Display for EnvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EnvError::Missing { name, or: Some(b) } => write!(f, "{name} (or {b}) is not set"),
            EnvError::Missing { name, or: None } => write!(f, "{name} is not set"),
            EnvError::Bad(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for EnvError {}

impl From<ParamError> for EnvError {
    fn from(e: ParamError) -> Self {
        EnvError::Bad(e)
    }
}

fn required<T: params::FromParam>(p: Param<T>, lookup: Lookup<'_>) -> Result<T, EnvError> {
    p.try_get_from(lookup)?.ok_or(EnvError::Missing {
        name: p.name(),
        or: None,
    })
}

fn text(lookup: Lookup<'_>, name: &'static str) -> Result<String, EnvError> {
    lookup(name).ok_or(EnvError::Missing { name, or: None })
}

/// What torchrun reads (`PET_*`): set for every program so that
/// `torchrun`-style code finds the job without flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TorchRunEnv {
    pub nnodes: u32,
    pub node_rank: u32,
    pub nproc_per_node: u32,
    pub master_addr: String,
    pub master_port: u16,
}

impl TorchRunEnv {
    pub fn to_vars(&self) -> Vars {
        vec![
            (PET_NNODES, self.nnodes.to_string()),
            (PET_NODE_RANK, self.node_rank.to_string()),
            (PET_NPROC_PER_NODE, self.nproc_per_node.to_string()),
            (PET_MASTER_ADDR, self.master_addr.clone()),
            (PET_MASTER_PORT, self.master_port.to_string()),
        ]
    }

    pub fn from_lookup(lookup: Lookup<'_>) -> Result<TorchRunEnv, EnvError> {
        let num = |name: &'static str| -> Result<u32, EnvError> {
            let v = text(lookup, name)?;
            v.trim()
                .parse()
                .map_err(|_| bad(name, &v, "a whole number"))
        };
        let port = text(lookup, PET_MASTER_PORT)?;
        Ok(TorchRunEnv {
            nnodes: num(PET_NNODES)?,
            node_rank: num(PET_NODE_RANK)?,
            nproc_per_node: num(PET_NPROC_PER_NODE)?,
            master_addr: text(lookup, PET_MASTER_ADDR)?,
            master_port: port
                .trim()
                .parse()
                .map_err(|_| bad(PET_MASTER_PORT, &port, "a port"))?,
        })
    }
}

fn bad(name: &'static str, value: &str, expected: &str) -> EnvError {
    EnvError::Bad(ParamError {
        name,
        value: value.to_string(),
        expected: expected.to_string(),
    })
}

/// The operator -> pod contract: every workload container and the sidecar of
/// replica `node_rank` get these (docs/KUBERNETES.md, "The pod contract").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodEnv {
    /// `WEFT_JOB`.
    pub job: String,
    /// `WEFT_JOB_NAMESPACE`.
    pub namespace: String,
    /// `WEFT_WORLD_SIZE`: replicas x ranks per replica.
    pub world_size: u32,
    /// `WEFT_RANK_OFFSET`: the rank of this pod's first rank.
    pub rank_offset: u32,
    /// `WEFT_LOCAL_RANKS`: ranks per replica.
    pub local_ranks: u32,
    /// `WEFT_NNODES`: replicas.
    pub nnodes: u32,
    /// `WEFT_NODE_RANK`: this replica's index.
    pub node_rank: u32,
    /// `WEFT_BOOTSTRAP`: `host:port` of pod 0's rendezvous.
    pub bootstrap: String,
    /// `WEFT_SIDECAR_SOCKET`.
    pub sidecar_socket: String,
    /// `WEFT_JOB_SECRET_FILE`: the mounted job secret.
    pub secret_file: String,
    /// `WEFT_RESTART_EPOCH`.
    pub restart_epoch: u32,
    /// `WEFT_INCARNATION`: 0 for the pods an epoch starts with, n for the
    /// n-th replacement of this pod within the epoch (onRankFailure:
    /// ReplaceRank). Read as 0 when unset (pods of older operators).
    pub incarnation: u32,
    /// `WEFT_RECOVERY_DIR`: the pod's recovery board, which its sidecar
    /// relays to the other pods' (onRankFailure: ReplaceRank only).
    pub recovery_dir: Option<String>,
    /// `WEFT_TRANSPORT`.
    pub transport: String,
    /// `WEFT_NET_IF`, when the job names an interface.
    pub net_if: Option<String>,
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`, when telemetry is configured.
    pub otlp_endpoint: Option<String>,
    /// `PET_*`.
    pub torch: TorchRunEnv,
}

impl PodEnv {
    /// The variables, in the order the operator sets them.
    pub fn to_vars(&self) -> Vars {
        let mut v: Vars = vec![
            (WEFT_JOB, self.job.clone()),
            (WEFT_JOB_NAMESPACE, self.namespace.clone()),
            (WEFT_WORLD_SIZE, self.world_size.to_string()),
            (WEFT_RANK_OFFSET, self.rank_offset.to_string()),
            (WEFT_LOCAL_RANKS, self.local_ranks.to_string()),
            (WEFT_NNODES, self.nnodes.to_string()),
            (WEFT_NODE_RANK, self.node_rank.to_string()),
            (WEFT_BOOTSTRAP, self.bootstrap.clone()),
            (WEFT_SIDECAR_SOCKET, self.sidecar_socket.clone()),
            (WEFT_JOB_SECRET_FILE, self.secret_file.clone()),
            (WEFT_RESTART_EPOCH, self.restart_epoch.to_string()),
            (WEFT_INCARNATION, self.incarnation.to_string()),
            (WEFT_TRANSPORT, self.transport.clone()),
        ];
        if let Some(i) = &self.net_if {
            v.push((WEFT_NET_IF, i.clone()));
        }
        if let Some(d) = &self.recovery_dir {
            v.push((WEFT_RECOVERY_DIR, d.clone()));
        }
        if let Some(ep) = &self.otlp_endpoint {
            v.push((OTEL_EXPORTER_OTLP_ENDPOINT, ep.clone()));
        }
        v.extend(self.torch.to_vars());
        v
    }

    /// Parses what [`PodEnv::to_vars`] sets (inside a pod: from the environment).
    pub fn from_lookup(lookup: Lookup<'_>) -> Result<PodEnv, EnvError> {
        let num = |p: Param<usize>| -> Result<u32, EnvError> {
            let n = required(p, lookup)?;
            u32::try_from(n).map_err(|_| bad(p.name(), &n.to_string(), "at most 2^32 - 1"))
        };
        let epoch = text(lookup, WEFT_RESTART_EPOCH)?;
        Ok(PodEnv {
            job: text(lookup, WEFT_JOB)?,
            namespace: text(lookup, WEFT_JOB_NAMESPACE)?,
            world_size: num(params::WEFT_WORLD_SIZE)?,
            rank_offset: num(params::WEFT_RANK_OFFSET)?,
            local_ranks: num(params::WEFT_LOCAL_RANKS)?,
            nnodes: num(params::WEFT_NNODES)?,
            node_rank: num(params::WEFT_NODE_RANK)?,
            bootstrap: text(lookup, WEFT_BOOTSTRAP)?,
            sidecar_socket: text(lookup, WEFT_SIDECAR_SOCKET)?,
            secret_file: text(lookup, WEFT_JOB_SECRET_FILE)?,
            restart_epoch: epoch
                .trim()
                .parse()
                .map_err(|_| bad(WEFT_RESTART_EPOCH, &epoch, "a whole number"))?,
            incarnation: params::WEFT_INCARNATION.try_get_from(lookup)?.unwrap_or(0),
            recovery_dir: lookup(WEFT_RECOVERY_DIR),
            transport: text(lookup, WEFT_TRANSPORT)?,
            net_if: lookup(WEFT_NET_IF),
            otlp_endpoint: lookup(OTEL_EXPORTER_OTLP_ENDPOINT),
            torch: TorchRunEnv::from_lookup(lookup)?,
        })
    }

    /// [`PodEnv::from_lookup`] on the process environment.
    pub fn from_env() -> Result<PodEnv, EnvError> {
        Self::from_lookup(&params::process_env)
    }
}

/// The launcher -> rank contract: what `weft run` gives each rank process (on
/// top of the environment the rank inherits).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    /// `WEFT_RANK`, `RANK`.
    pub rank: usize,
    /// `WEFT_LOCAL_RANK`, `LOCAL_RANK`.
    pub local_rank: usize,
    /// `WEFT_WORLD_SIZE`, `WORLD_SIZE`.
    pub world_size: usize,
    /// `WEFT_LOCAL_RANKS`, `LOCAL_WORLD_SIZE`, `PET_NPROC_PER_NODE`.
    pub local_ranks: usize,
    /// `WEFT_RANK_OFFSET`.
    pub rank_offset: usize,
    /// `WEFT_NNODES`, `PET_NNODES`.
    pub nnodes: usize,
    /// `WEFT_NODE_RANK`, `PET_NODE_RANK`.
    pub node_rank: usize,
    /// `WEFT_BOOTSTRAP` and `NCCL_COMM_ID`: `host:port` of the rendezvous.
    pub bootstrap: String,
    /// `WEFT_JOB`.
    pub job: String,
    /// `MASTER_ADDR` / `PET_MASTER_ADDR`.
    pub master_addr: String,
    /// `MASTER_PORT` / `PET_MASTER_PORT`: distinct from the bootstrap port, so
    /// a PyTorch store and Weft's bootstrap never fight over one port.
    pub master_port: u16,
    /// `WEFT_JOB_SECRET`: `None` when the rank inherits one.
    pub secret: Option<String>,
}

impl RankEnv {
    /// The variables, in the order `weft run` sets them.
    pub fn to_vars(&self) -> Vars {
        let r = self.rank.to_string();
        let lr = self.local_rank.to_string();
        let n = self.world_size.to_string();
        let ln = self.local_ranks.to_string();
        let port = self.master_port.to_string();
        let mut v: Vars = vec![
            (WEFT_RANK, r.clone()),
            (WEFT_LOCAL_RANK, lr.clone()),
            (WEFT_WORLD_SIZE, n.clone()),
            (WEFT_LOCAL_RANKS, ln.clone()),
            (WEFT_RANK_OFFSET, self.rank_offset.to_string()),
            (WEFT_NNODES, self.nnodes.to_string()),
            (WEFT_NODE_RANK, self.node_rank.to_string()),
            (WEFT_BOOTSTRAP, self.bootstrap.clone()),
            (NCCL_COMM_ID, self.bootstrap.clone()),
            (WEFT_JOB, self.job.clone()),
            (RANK, r),
            (LOCAL_RANK, lr),
            (WORLD_SIZE, n),
            (LOCAL_WORLD_SIZE, ln.clone()),
            (MASTER_ADDR, self.master_addr.clone()),
            (MASTER_PORT, port.clone()),
            (PET_NNODES, self.nnodes.to_string()),
            (PET_NODE_RANK, self.node_rank.to_string()),
            (PET_NPROC_PER_NODE, ln),
            (PET_MASTER_ADDR, self.master_addr.clone()),
            (PET_MASTER_PORT, port),
        ];
        if let Some(s) = &self.secret {
            v.push((WEFT_JOB_SECRET, s.clone()));
        }
        v
    }

    /// Parses what [`RankEnv::to_vars`] sets (every variable required, the
    /// `WEFT_*` name first); `secret` is `WEFT_JOB_SECRET` when set.
    pub fn from_lookup(lookup: Lookup<'_>) -> Result<RankEnv, EnvError> {
        let id = RankId::from_lookup(lookup)?;
        let either = |a: Param<usize>, b: &'static str| -> Result<usize, EnvError> {
            match a.try_get_from(lookup)? {
                Some(v) => Ok(v),
                None => {
                    let v = lookup(b).ok_or(EnvError::Missing {
                        name: a.name(),
                        or: Some(b),
                    })?;
                    v.trim().parse().map_err(|_| bad(b, &v, "a whole number"))
                }
            }
        };
        let port = text(lookup, MASTER_PORT)?;
        Ok(RankEnv {
            rank: id.rank,
            world_size: id.world_size,
            local_rank: either(params::WEFT_LOCAL_RANK, LOCAL_RANK)?,
            local_ranks: either(params::WEFT_LOCAL_RANKS, LOCAL_WORLD_SIZE)?,
            rank_offset: required(params::WEFT_RANK_OFFSET, lookup)?,
            nnodes: either(params::WEFT_NNODES, PET_NNODES)?,
            node_rank: either(params::WEFT_NODE_RANK, PET_NODE_RANK)?,
            bootstrap: BootstrapEnv::addr_from(lookup)?,
            job: text(lookup, WEFT_JOB)?,
            master_addr: text(lookup, MASTER_ADDR)?,
            master_port: port
                .trim()
                .parse()
                .map_err(|_| bad(MASTER_PORT, &port, "a port"))?,
            secret: params::WEFT_JOB_SECRET.get_from(lookup),
        })
    }

    /// [`RankEnv::from_lookup`] on the process environment.
    pub fn from_env() -> Result<RankEnv, EnvError> {
        Self::from_lookup(&params::process_env)
    }
}

/// A rank's place in its job, the minimum a rank process needs: `WEFT_RANK`
/// (else `RANK`) and `WEFT_WORLD_SIZE` (else `WORLD_SIZE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankId {
    pub rank: usize,
    pub world_size: usize,
}

impl RankId {
    /// The `WEFT_*` name wins when set at all (even if it does not parse).
    pub fn from_lookup(lookup: Lookup<'_>) -> Result<RankId, EnvError> {
        let get = |a: Param<usize>, b: Param<usize>| -> Result<usize, EnvError> {
            let (name, v) = match lookup(a.name()) {
                Some(v) => (a.name(), v),
                None => (
                    b.name(),
                    lookup(b.name()).ok_or(EnvError::Missing {
                        name: a.name(),
                        or: Some(b.name()),
                    })?,
                ),
            };
            v.trim()
                .parse()
                .map_err(|_| bad(name, &v, "a whole number"))
        };
        Ok(RankId {
            rank: get(params::WEFT_RANK, params::RANK)?,
            world_size: get(params::WEFT_WORLD_SIZE, params::WORLD_SIZE)?,
        })
    }

    pub fn from_env() -> Result<RankId, EnvError> {
        Self::from_lookup(&params::process_env)
    }
}

/// Where the job secret comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SecretSource {
    /// `WEFT_JOB_SECRET` (set and not empty).
    Inline(String),
    /// `WEFT_JOB_SECRET_FILE` (set, `WEFT_JOB_SECRET` is not): the file's path.
    File(String),
}

impl SecretSource {
    /// `WEFT_JOB_SECRET` when set and not empty, else the file
    /// `WEFT_JOB_SECRET_FILE` names when that is set (even empty), else None.
    pub fn from_lookup(lookup: Lookup<'_>) -> Option<SecretSource> {
        if let Some(s) = lookup(WEFT_JOB_SECRET).filter(|s| !s.is_empty()) {
            return Some(SecretSource::Inline(s));
        }
        lookup(WEFT_JOB_SECRET_FILE).map(SecretSource::File)
    }

    pub fn from_env() -> Option<SecretSource> {
        Self::from_lookup(&params::process_env)
    }

    /// The secret: the inline value, or the file's content, trimmed.
    pub fn read(&self) -> std::io::Result<String> {
        match self {
            SecretSource::Inline(s) => Ok(s.clone()),
            SecretSource::File(path) => Ok(std::fs::read_to_string(path)?.trim().to_string()),
        }
    }
}

/// What a rank needs to compute the job's bootstrap id: where rank 0 serves
/// the rendezvous, the job, its restart epoch and the secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BootstrapEnv {
    /// `WEFT_BOOTSTRAP`, else `NCCL_COMM_ID` (each only when not blank).
    pub addr: String,
    /// `WEFT_JOB` ("" when unset).
    pub job: String,
    /// `WEFT_RESTART_EPOCH` ("" when unset).
    pub restart_epoch: String,
    pub secret: Option<SecretSource>,
}

impl BootstrapEnv {
    fn addr_from(lookup: Lookup<'_>) -> Result<String, EnvError> {
        let set = |k: &str| lookup(k).filter(|v| !v.trim().is_empty());
        set(WEFT_BOOTSTRAP)
            .or_else(|| set(NCCL_COMM_ID))
            .ok_or(EnvError::Missing {
                name: WEFT_BOOTSTRAP,
                or: Some(NCCL_COMM_ID),
            })
    }

    /// Whether a bootstrap address is set (`WEFT_BOOTSTRAP` or `NCCL_COMM_ID`, not blank).
    pub fn is_set_in(lookup: Lookup<'_>) -> bool {
        Self::addr_from(lookup).is_ok()
    }

    pub fn from_lookup(lookup: Lookup<'_>) -> Result<BootstrapEnv, EnvError> {
        Ok(BootstrapEnv {
            addr: Self::addr_from(lookup)?,
            job: lookup(WEFT_JOB).unwrap_or_default(),
            restart_epoch: lookup(WEFT_RESTART_EPOCH).unwrap_or_default(),
            secret: SecretSource::from_lookup(lookup),
        })
    }

    pub fn from_env() -> Result<BootstrapEnv, EnvError> {
        Self::from_lookup(&params::process_env)
    }
}

/// Where this process is asked to send its spans, by OpenTelemetry's rule:
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT`
/// (empty is unset), and nothing when `OTEL_SDK_DISABLED` is `true` (any
/// case; OTel's only disabling value). The variable that names it and its
/// value; None: no export.
pub fn otlp_endpoint_from(lookup: Lookup<'_>) -> Option<(&'static str, String)> {
    let disabled =
        lookup(params::OTEL_SDK_DISABLED.name()).is_some_and(|v| v.eq_ignore_ascii_case("true"));
    if disabled {
        return None;
    }
    [
        params::OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
        params::OTEL_EXPORTER_OTLP_ENDPOINT,
    ]
    .into_iter()
    .find_map(|p| {
        lookup(p.name())
            .filter(|v| !v.is_empty())
            .map(|v| (p.name(), v))
    })
}

pub fn otlp_endpoint() -> Option<(&'static str, String)> {
    otlp_endpoint_from(&params::process_env)
}

#[cfg(test)]
mod tests;
