//! `weft run`'s side of the environment contract between a launcher and each
//! rank process: the job-wide values of one local launch, turned into each
//! rank's [`RankEnv`] (the names and their meaning live in
//! `weft_contract::env`, shared with the operator and libcomm).

use std::io;
use std::net::{Ipv4Addr, TcpListener};
use weft_contract::env::{EnvError, PodEnv, RankEnv, names};
use weft_contract::params::Lookup;

/// Loopback address every local rank uses for rendezvous.
pub const LOCALHOST: &str = "127.0.0.1";

/// Job-wide values shared by all ranks of one local launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobEnv {
    /// `WEFT_JOB`: names the job; shared-memory segments are `/dev/shm/weft-<job>-*`.
    pub job: String,
    /// Number of ranks (all on this node).
    pub world_size: usize,
    /// `WEFT_BOOTSTRAP` and `NCCL_COMM_ID`: `host:port` of the rendezvous.
    pub bootstrap: String,
    /// `MASTER_PORT` / `PET_MASTER_PORT`: distinct from the bootstrap port, so
    /// a PyTorch store and Weft's bootstrap never fight over one port.
    pub master_port: u16,
    /// `WEFT_JOB_SECRET`: `None` when the launcher's own environment already
    /// has one (the ranks inherit it).
    pub secret: Option<String>,
    /// Inside a pod of an operator job: this pod's place in the job (its
    /// ranks are `rank_offset..rank_offset + world_size` of `global_world`).
    pub pod: Option<PodPlace>,
}

/// Where the ranks `weft run` starts inside an operator pod sit in the job:
/// the pod contract (`weft_contract::env::PodEnv`) the operator set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodPlace {
    /// `WEFT_WORLD_SIZE`: every pod's ranks.
    pub global_world: usize,
    /// `WEFT_RANK_OFFSET`: this pod's first rank.
    pub rank_offset: usize,
    /// `WEFT_NNODES`, `WEFT_NODE_RANK`.
    pub nnodes: usize,
    pub node_rank: usize,
    /// `PET_MASTER_ADDR` (pod 0's DNS name): torch's store lives there.
    pub master_addr: String,
}

impl JobEnv {
    /// The contract for the `local`-th rank this launcher starts (in a pod:
    /// global rank `rank_offset + local` of the pod's job).
    pub fn rank_env(&self, local: usize) -> RankEnv {
        let (offset, world, nnodes, node_rank, master_addr) = match &self.pod {
            Some(p) => (
                p.rank_offset,
                p.global_world,
                p.nnodes,
                p.node_rank,
                p.master_addr.clone(),
            ),
            None => (0, self.world_size, 1, 0, LOCALHOST.into()),
        };
        RankEnv {
            rank: offset + local,
            local_rank: local,
            world_size: world,
            local_ranks: self.world_size,
            rank_offset: offset,
            nnodes,
            node_rank,
            bootstrap: self.bootstrap.clone(),
            job: self.job.clone(),
            master_addr,
            master_port: self.master_port,
            secret: self.secret.clone(),
        }
    }

    /// The variables for the `local`-th rank, to be set on top of the
    /// inherited environment.
    pub fn rank_vars(&self, local: usize) -> Vec<(String, String)> {
        self.rank_env(local)
            .to_vars()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }
}

/// The operator's pod contract when this process runs in one of its pods
/// (`WEFT_RESTART_EPOCH` is the operator's mark: `weft run` never sets it);
/// `None` elsewhere.
pub fn operator_pod(lookup: Lookup<'_>) -> Result<Option<PodEnv>, EnvError> {
    if lookup(names::WEFT_RESTART_EPOCH).is_none() {
        return Ok(None);
    }
    PodEnv::from_lookup(lookup).map(Some)
}

/// The rank a launcher gave this process (`WEFT_RANK`), when one started it:
/// such a process is one of its job's ranks, never the start of a new set.
pub fn launched_rank(lookup: Lookup<'_>) -> Option<String> {
    lookup(names::WEFT_RANK)
}

/// Job names end up in file names (`/dev/shm/weft-<job>-*`) and in Kubernetes
/// object names, so keep them to a safe alphabet.
pub fn validate_job(job: &str) -> Result<(), String> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.';
    if job.is_empty() || job.len() > 200 || job.starts_with('.') || !job.chars().all(ok_char) {
        return Err(format!(
            "invalid job name '{job}': use 1-200 characters from [A-Za-z0-9._-], not starting with '.'"
        ));
    }
    Ok(())
}

/// Checks a `HOST:PORT` bootstrap address and returns its port.
pub fn parse_bootstrap(addr: &str) -> Result<u16, String> {
    let bad = || format!("invalid bootstrap address '{addr}': expected HOST:PORT");
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    if host.is_empty() || port == 0 {
        return Err(bad());
    }
    Ok(port)
}

/// Finds `count` distinct free TCP ports on 127.0.0.1, none equal to `avoid`.
///
/// All listeners are held until every port is chosen, so the kernel cannot hand
/// out the same port twice; they are closed on return (the usual small race
/// with other processes remains, as with every launcher that does this).
pub fn free_ports(count: usize, avoid: Option<u16>) -> io::Result<Vec<u16>> {
    let mut held = Vec::new();
    let mut ports = Vec::new();
    // A few extra tries in case the kernel hands out `avoid` itself.
    for _ in 0..count + 8 {
        if ports.len() == count {
            break;
        }
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let p = l.local_addr()?.port();
        held.push(l);
        if Some(p) != avoid {
            ports.push(p);
        }
    }
    if ports.len() < count {
        return Err(io::Error::other(
            "could not find free TCP ports on 127.0.0.1",
        ));
    }
    Ok(ports)
}

/// 32 random bytes from the OS as 64 lowercase hex characters.
pub fn fresh_secret() -> io::Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| io::Error::other(format!("getrandom: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_vars_are_the_contract() {
        let job = JobEnv {
            job: "j".into(),
            world_size: 3,
            bootstrap: "127.0.0.1:7000".into(),
            master_port: 7001,
            secret: Some("s".into()),
            pod: None,
        };
        let got = job.rank_vars(1);
        let want = [
            ("WEFT_RANK", "1"),
            ("WEFT_LOCAL_RANK", "1"),
            ("WEFT_WORLD_SIZE", "3"),
            ("WEFT_LOCAL_RANKS", "3"),
            ("WEFT_RANK_OFFSET", "0"),
            ("WEFT_NNODES", "1"),
            ("WEFT_NODE_RANK", "0"),
            ("WEFT_BOOTSTRAP", "127.0.0.1:7000"),
            ("NCCL_COMM_ID", "127.0.0.1:7000"),
            ("WEFT_JOB", "j"),
            ("RANK", "1"),
            ("LOCAL_RANK", "1"),
            ("WORLD_SIZE", "3"),
            ("LOCAL_WORLD_SIZE", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "7001"),
            ("PET_NNODES", "1"),
            ("PET_NODE_RANK", "0"),
            ("PET_NPROC_PER_NODE", "3"),
            ("PET_MASTER_ADDR", "127.0.0.1"),
            ("PET_MASTER_PORT", "7001"),
            ("WEFT_JOB_SECRET", "s"),
        ];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(got, want);
        let inherited = JobEnv {
            secret: None,
            ..job
        };
        assert_eq!(inherited.rank_vars(0).len(), want.len() - 1);
    }

    /// Inside a pod, the local ranks are the pod's slice of the job.
    #[test]
    fn rank_vars_in_a_pod_are_the_pods_slice() {
        let job = JobEnv {
            job: "j".into(),
            world_size: 2,
            bootstrap: "j-0.j.ns.svc:29400".into(),
            master_port: 29500,
            secret: None,
            pod: Some(PodPlace {
                global_world: 8,
                rank_offset: 4,
                nnodes: 4,
                node_rank: 2,
                master_addr: "j-0.j.ns.svc".into(),
            }),
        };
        let v: std::collections::BTreeMap<String, String> = job.rank_vars(1).into_iter().collect();
        for (k, want) in [
            ("WEFT_RANK", "5"),
            ("RANK", "5"),
            ("WEFT_LOCAL_RANK", "1"),
            ("WEFT_WORLD_SIZE", "8"),
            ("WEFT_LOCAL_RANKS", "2"),
            ("WEFT_RANK_OFFSET", "4"),
            ("WEFT_NNODES", "4"),
            ("WEFT_NODE_RANK", "2"),
            ("WEFT_BOOTSTRAP", "j-0.j.ns.svc:29400"),
            ("MASTER_ADDR", "j-0.j.ns.svc"),
            ("PET_MASTER_PORT", "29500"),
        ] {
            assert_eq!(v[k], want, "{k}");
        }
        assert!(
            !v.contains_key("WEFT_JOB_SECRET"),
            "the pod's secret file is inherited"
        );
    }

    #[test]
    fn bootstrap_parsing() {
        assert_eq!(parse_bootstrap("127.0.0.1:29500"), Ok(29500));
        assert_eq!(parse_bootstrap("[::1]:7"), Ok(7));
        assert!(parse_bootstrap("nohost").is_err());
        assert!(parse_bootstrap(":80").is_err());
        assert!(parse_bootstrap("h:0").is_err());
        assert!(parse_bootstrap("h:99999").is_err());
    }

    #[test]
    fn job_names() {
        assert!(validate_job("local-123").is_ok());
        assert!(validate_job("a/b").is_err());
        assert!(validate_job("").is_err());
        assert!(validate_job("..").is_err());
    }

    #[test]
    fn ports_are_distinct_and_avoid() {
        let p = free_ports(2, None).unwrap();
        assert_ne!(p[0], p[1]);
        let q = free_ports(1, Some(p[0])).unwrap();
        assert_ne!(q[0], p[0]);
    }

    #[test]
    fn secret_is_64_hex() {
        let s = fresh_secret().unwrap();
        assert_eq!(s.len(), 64);
        assert!(s.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(s, fresh_secret().unwrap());
    }
}
