//! Where `weft bench` runs, and so what it starts.
//!
//! - On its own: it launches `-n` ranks (default 2) on this machine.
//! - In a pod of a CollectiveJob (the operator's pod contract): it launches
//!   the pod's share of the job, `WEFT_LOCAL_RANKS` ranks numbered from
//!   `WEFT_RANK_OFFSET`, in a world of `WEFT_WORLD_SIZE` ranks that every pod
//!   joins through the job's rendezvous. A pod's command is then just
//!   `weft bench all_reduce ...`.
//! - As a rank a launcher already started (`WEFT_RANK` set, e.g.
//!   `weft run -n 2 -- weft bench ...`): it is that one rank.
//!
//! `-n` is always the world size: in a pod or as a rank the environment says
//! it, and a different `-n` is refused rather than guessed at.

use weft_contract::params::Lookup;

use crate::launch::env::{launched_rank, operator_pod};

/// Ranks `weft bench` starts when it runs on its own and `-n` is not given.
pub const DEFAULT_RANKS: u32 = 2;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Launch all `world` ranks here.
    Local { world: u32 },
    /// Launch this pod's `local` ranks, `first..first + local` of `world`.
    Pod { world: u32, local: u32, first: u32 },
    /// Be one rank of a `world`-rank job a launcher started.
    Rank { world: u32 },
}

impl Placement {
    /// From the environment `lookup` and the `-n` asked for, if any.
    pub fn detect(asked: Option<u32>, lookup: Lookup<'_>) -> Result<Placement, String> {
        if let Some(rank) = launched_rank(lookup) {
            let world = lookup(weft_contract::env::names::WEFT_WORLD_SIZE)
                .and_then(|w| w.trim().parse::<u32>().ok())
                .ok_or_else(|| {
                    format!("started as rank {rank} (WEFT_RANK) without a valid WEFT_WORLD_SIZE")
                })?;
            same_world(asked, world, "this rank's job")?;
            return Ok(Placement::Rank { world });
        }
        if let Some(pod) =
            operator_pod(lookup).map_err(|e| format!("inside an operator pod: {e}"))?
        {
            same_world(asked, pod.world_size, "this pod's job")?;
            return Ok(Placement::Pod {
                world: pod.world_size,
                local: pod.local_ranks,
                first: pod.rank_offset,
            });
        }
        Ok(Placement::Local {
            world: asked.unwrap_or(DEFAULT_RANKS),
        })
    }

    /// Ranks in the whole benchmark.
    pub fn world(&self) -> u32 {
        match *self {
            Placement::Local { world }
            | Placement::Pod { world, .. }
            | Placement::Rank { world } => world,
        }
    }

    /// Rank processes this `weft bench` starts (none as a rank: it is one).
    pub fn to_start(&self) -> u32 {
        match *self {
            Placement::Local { world } => world,
            Placement::Pod { local, .. } => local,
            Placement::Rank { .. } => 0,
        }
    }
}

fn same_world(asked: Option<u32>, world: u32, whose: &str) -> Result<(), String> {
    match asked {
        Some(n) if n != world => Err(format!(
            "-n {n} asked, but {whose} has {world} ranks (WEFT_WORLD_SIZE): -n is the whole job's size; leave it out"
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// The variables the operator gives pod `index` of a job of `pods` pods
    /// with `per_pod` ranks each (docs/KUBERNETES.md, "The pod contract").
    fn pod_contract(pods: u32, per_pod: u32, index: u32) -> BTreeMap<String, String> {
        let pod = weft_contract::env::PodEnv {
            job: "b".into(),
            namespace: "ns".into(),
            world_size: pods * per_pod,
            rank_offset: index * per_pod,
            local_ranks: per_pod,
            nnodes: pods,
            node_rank: index,
            bootstrap: "b-0.b.ns.svc:29400".into(),
            sidecar_socket: "/run/weft/sidecar.sock".into(),
            secret_file: "/etc/weft/secret/token".into(),
            restart_epoch: 0,
            incarnation: 0,
            recovery_dir: None,
            transport: "auto".into(),
            net_if: None,
            otlp_endpoint: None,
            torch: weft_contract::env::TorchRunEnv {
                nnodes: pods,
                node_rank: index,
                nproc_per_node: per_pod,
                master_addr: "b-0.b.ns.svc".into(),
                master_port: 29500,
            },
        };
        pod.to_vars()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    fn detect(asked: Option<u32>, env: &BTreeMap<String, String>) -> Result<Placement, String> {
        Placement::detect(asked, &|k: &str| env.get(k).cloned())
    }

    #[test]
    fn on_its_own_it_starts_n_ranks() {
        let none = BTreeMap::new();
        assert_eq!(detect(None, &none), Ok(Placement::Local { world: 2 }));
        assert_eq!(detect(Some(5), &none), Ok(Placement::Local { world: 5 }));
        assert_eq!(Placement::Local { world: 5 }.to_start(), 5);
    }

    #[test]
    fn in_a_pod_it_starts_the_pods_share_of_the_job() {
        let env = pod_contract(2, 2, 1);
        let p = detect(None, &env).unwrap();
        assert_eq!(
            p,
            Placement::Pod {
                world: 4,
                local: 2,
                first: 2
            }
        );
        assert_eq!((p.world(), p.to_start()), (4, 2));
        // -n may repeat the job's size, not name the pod's ranks.
        assert_eq!(detect(Some(4), &env), Ok(p));
        let e = detect(Some(2), &env).unwrap_err();
        assert!(e.contains("-n 2") && e.contains("4 ranks"), "{e}");
    }

    #[test]
    fn a_rank_started_by_a_launcher_is_that_rank() {
        // `weft run -n 2 -- weft bench` in pod 1: the launcher gave the rank
        // its global number and the job's world.
        let mut env = pod_contract(2, 2, 1);
        env.insert("WEFT_RANK".into(), "3".into());
        let p = detect(None, &env).unwrap();
        assert_eq!(p, Placement::Rank { world: 4 });
        assert_eq!(p.to_start(), 0);
        assert!(detect(Some(2), &env).is_err());
        env.remove("WEFT_WORLD_SIZE");
        assert!(detect(None, &env).unwrap_err().contains("WEFT_WORLD_SIZE"));
    }

    #[test]
    fn an_incomplete_pod_contract_is_an_error_not_a_local_run() {
        let mut env = pod_contract(2, 1, 0);
        env.remove("WEFT_BOOTSTRAP");
        let e = detect(None, &env).unwrap_err();
        assert!(e.contains("WEFT_BOOTSTRAP"), "{e}");
    }
}
