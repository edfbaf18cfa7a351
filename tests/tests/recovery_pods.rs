//! In-place recovery the way the operator runs it (`onRankFailure:
//! ReplaceRank`, issue 20), without Kubernetes: every "pod" is a `weft
//! sidecar` with its own recovery board directory and peer port, and a
//! workload `weft run -n 1 -- rank-worker train ...` given the operator's
//! pod contract (WEFT_RANK_OFFSET, WEFT_NNODES, WEFT_INCARNATION,
//! WEFT_RECOVERY_DIR, the job secret as a file, ...) and a host name of its
//! own (so ranks of different pods talk over TCP, not shared memory). The
//! test plays the kubelet and the operator: when a pod's workload exits it
//! SIGTERMs that pod's sidecar and starts a new pod with the same rank and
//! incarnation + 1, a fresh (empty) board and the same peer address. Nothing
//! but the sidecars' relay connects the boards: the survivors learn the
//! death, the replacement's readiness reaches them, and its grow id reaches
//! it, all through the peer port. Final weights must equal a run without
//! failure bit for bit. Every run is bounded.

mod common;

use common::cli;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weft_tests::sidecar::Sidecar;

const STEPS: u64 = 40;
/// The whole scenario, reference run included, ends within this.
const LIMIT: Duration = Duration::from_secs(120);

/// One pod: its sidecar and its workload (`weft run -n 1`).
struct Pod {
    index: usize,
    incarnation: u32,
    sidecar: Sidecar,
    workload: Child,
    out: Arc<Mutex<String>>,
    root: PathBuf,
}

/// The job: its pods (the current incarnation of each) and what every pod
/// shares (job name and secret, peer addresses, rendezvous).
struct Job {
    n: usize,
    peers: Vec<String>,
    bootstrap: String,
    secret_file: PathBuf,
    args: Vec<String>,
    /// Output of every incarnation of every pod, in order.
    logs: Vec<Vec<Arc<Mutex<String>>>>,
    tag: String,
    /// `WEFT_TIMEOUT_MS` of the ranks (a frozen peer is noticed after it).
    timeout_ms: &'static str,
}

/// Ports a pod keeps across its incarnations: below the kernel's ephemeral
/// range (32768 and up), so that while a replacement is starting no other
/// process's outgoing connection or port-0 listener can take its port.
fn free_ports(n: usize) -> Vec<u16> {
    let mut ports: Vec<u16> = Vec::new();
    for _ in 0..1000 {
        if ports.len() == n {
            return ports;
        }
        // Randomly keyed per call: tests running at once pick apart.
        use std::hash::{BuildHasher, Hasher};
        let r = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let p = 20000 + (r % 12000) as u16;
        if !ports.contains(&p) && std::net::TcpListener::bind(("127.0.0.1", p)).is_ok() {
            ports.push(p);
        }
    }
    panic!("no {n} free ports in 20000..32000 on 127.0.0.1");
}

impl Job {
    fn new(n: usize, args: Vec<String>) -> Job {
        let ports = free_ports(n + 2);
        let tag = format!("pods{}x{}", std::process::id(), ports[0]);
        let secret_file = std::env::temp_dir().join(format!("weft-{tag}-secret"));
        std::fs::write(&secret_file, weft::launch::env::fresh_secret().unwrap()).unwrap();
        Job {
            n,
            peers: (0..n).map(|i| format!("127.0.0.1:{}", ports[i])).collect(),
            bootstrap: format!("127.0.0.1:{}", ports[n]),
            secret_file,
            args,
            logs: vec![Vec::new(); n],
            tag,
            timeout_ms: "1500",
        }
    }

    /// Starts incarnation `inc` of pod `i` (its sidecar first, as the
    /// operator's native sidecar starts before the workload).
    fn start_pod(&mut self, i: usize, inc: u32) -> Pod {
        let secret = std::fs::read_to_string(&self.secret_file).unwrap();
        let root = std::env::temp_dir().join(format!("weft-{}-pod{i}-{inc}", self.tag));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let board = root.join("board");
        let host = format!("pod{i}");
        let peers: Vec<String> = (0..self.n)
            .filter(|&j| j != i)
            .map(|j| self.peers[j].clone())
            .collect();
        let extra = vec![
            "--peer-listen".to_string(),
            self.peers[i].clone(),
            "--peers".into(),
            peers.join(","),
            "--peer-timeout-ms".into(),
            "3000".into(),
            "--peer-startup-grace-ms".into(),
            "60000".into(),
            // Ranks of different pods connect directly: every pod is on
            // loopback here, which the network proxy rightly refuses as
            // another host's address.
            "--no-proxy".into(),
        ];
        let contract = self.contract(i, inc, &board);
        let mut env: Vec<(&str, &str)> = contract
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        env.push(("WEFT_JOB_SECRET", secret.as_str()));
        let sidecar = Sidecar::start_in_job(cli(), None, &extra, &env, &self.tag, &secret);
        let mut cmd = Command::new(cli());
        cmd.args(["run", "-n", "1", "--grace", "1", "--"])
            .arg(common::worker())
            .arg("train")
            .args(&self.args)
            .env_remove("WEFT_JOB_SECRET")
            .envs(contract)
            .env("WEFT_SIDECAR_SOCKET", &sidecar.socket)
            .env("WEFT_HOSTNAME", format!("{host}-{inc}"))
            .env("WEFT_TIMEOUT_MS", self.timeout_ms)
            .env("WEFT_PEER_TIMEOUT_MS", "1000")
            .env("WEFT_INIT_TIMEOUT_MS", "30000")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut workload = cmd.spawn().expect("spawning weft run");
        let out = Arc::new(Mutex::new(String::new()));
        for pipe in [
            Box::new(workload.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(workload.stderr.take().unwrap()),
        ] {
            let o = out.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let mut o = o.lock().unwrap();
                    o.push_str(&l);
                    o.push('\n');
                }
            });
        }
        self.logs[i].push(out.clone());
        Pod {
            index: i,
            incarnation: inc,
            sidecar,
            workload,
            out,
            root,
        }
    }

    /// The operator's pod contract for incarnation `inc` of pod `i`.
    fn contract(&self, i: usize, inc: u32, board: &Path) -> Vec<(String, String)> {
        let n = self.n.to_string();
        let master = self.bootstrap.rsplit_once(':').unwrap().0.to_string();
        let master_port = free_ports(1)[0].to_string();
        [
            ("WEFT_JOB", self.tag.clone()),
            ("WEFT_JOB_NAMESPACE", "test".into()),
            ("WEFT_WORLD_SIZE", n.clone()),
            ("WEFT_RANK_OFFSET", i.to_string()),
            ("WEFT_LOCAL_RANKS", "1".into()),
            ("WEFT_NNODES", n.clone()),
            ("WEFT_NODE_RANK", i.to_string()),
            ("WEFT_BOOTSTRAP", self.bootstrap.clone()),
            (
                "WEFT_JOB_SECRET_FILE",
                self.secret_file.display().to_string(),
            ),
            ("WEFT_RESTART_EPOCH", "0".into()),
            ("WEFT_INCARNATION", inc.to_string()),
            ("WEFT_RECOVERY_DIR", board.display().to_string()),
            ("WEFT_TRANSPORT", "auto".into()),
            ("PET_NNODES", n),
            ("PET_NODE_RANK", i.to_string()),
            ("PET_NPROC_PER_NODE", "1".into()),
            ("PET_MASTER_ADDR", master),
            ("PET_MASTER_PORT", master_port),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    fn dump(&self) -> String {
        let mut s = String::new();
        for (i, incs) in self.logs.iter().enumerate() {
            for (inc, o) in incs.iter().enumerate() {
                s.push_str(&format!(
                    "--- pod {i} incarnation {inc}:\n{}",
                    o.lock().unwrap()
                ));
            }
        }
        s
    }
}

/// A pod's board as it is now (names and the start of each body): which
/// relay fell behind when a recovery did not happen.
fn board_listing(root: &Path) -> String {
    let dir = root.join("board");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .map(|rd| rd.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    names.sort();
    let mut s = format!("board {}:\n", dir.display());
    for n in names {
        let body = std::fs::read_to_string(dir.join(&n)).unwrap_or_default();
        // A report is a survivor's error: whole; other bodies are long ids.
        let keep = if n.to_string_lossy().starts_with("report-") {
            600
        } else {
            60
        };
        let head: String = body.replace('\n', " | ").chars().take(keep).collect();
        s.push_str(&format!("  {}: {head}\n", n.to_string_lossy()));
    }
    s
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.secret_file);
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = self.workload.kill();
        let _ = self.workload.wait();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// `@ event k=v ...` lines of `out`.
fn facts(out: &str) -> Vec<BTreeMap<String, String>> {
    out.lines()
        .filter_map(|l| l.split_once("@ ").map(|x| x.1))
        .map(|l| {
            let mut m = BTreeMap::new();
            for (i, w) in l.split_whitespace().enumerate() {
                match w.split_once('=') {
                    Some((k, v)) => {
                        if i == 0 {
                            m.insert("event".into(), k.to_string());
                        }
                        m.insert(k.to_string(), v.to_string());
                    }
                    None if i == 0 => {
                        m.insert("event".into(), w.to_string());
                    }
                    None => {}
                }
            }
            m
        })
        .collect()
}

/// Runs the job to its end, replacing every pod whose workload fails
/// (at most `max_replacements`); returns each pod's last output and the
/// number of replacements.
///
/// With `node_loss`, the pod whose rank announces its failure (`@ kill`)
/// loses its node instead: its sidecar is SIGKILLed first (it says nothing
/// to anyone), then its workload; only the other sidecars' heartbeats can
/// tell the survivors.
/// The replacement of a lost node's pod starts `node_loss` after the loss
/// (the time Kubernetes takes to declare a node lost and the pod failed).
fn run(
    job: &mut Job,
    max_replacements: usize,
    node_loss: Option<Duration>,
) -> (Vec<String>, usize) {
    let t0 = Instant::now();
    let mut pods: Vec<Option<Pod>> = (0..job.n).map(|i| Some(job.start_pod(i, 0))).collect();
    let mut replaced = 0;
    let mut done = vec![false; job.n];
    let mut node_lost = node_loss.is_none();
    while !done.iter().all(|d| *d) {
        if !node_lost {
            for p in pods.iter_mut().flatten() {
                if p.incarnation == 0 && p.out.lock().unwrap().contains("@ kill") {
                    p.sidecar.signal(libc::SIGKILL);
                    assert!(p.sidecar.wait(Duration::from_secs(10)).is_some());
                    let _ = p.workload.kill();
                    eprintln!(
                        "pod {}: node lost (sidecar and workload SIGKILLed)",
                        p.index
                    );
                    node_lost = true;
                }
            }
        }
        assert!(
            t0.elapsed() < LIMIT,
            "the job did not end within {LIMIT:?}:\n{}",
            job.dump()
        );
        for i in 0..job.n {
            if done[i] {
                continue;
            }
            let pod = pods[i].as_mut().unwrap();
            let Ok(Some(st)) = pod.workload.try_wait() else {
                continue;
            };
            if st.success() {
                done[i] = true;
                continue;
            }
            // The kubelet: the workload failed, the pod's sidecar is stopped.
            let mut old = pods[i].take().unwrap();
            old.sidecar.signal(libc::SIGTERM);
            assert!(
                old.sidecar.wait(Duration::from_secs(10)).is_some(),
                "pod {i}'s sidecar did not stop on SIGTERM:\n{}",
                old.sidecar.log()
            );
            let inc = old.incarnation + 1;
            let old_log = format!("{}{}", old.sidecar.log(), board_listing(&old.root));
            eprintln!(
                "pod {} incarnation {} failed ({st}) after {:?}: replacing it",
                old.index,
                old.incarnation,
                t0.elapsed()
            );
            drop(old);
            if replaced >= max_replacements {
                let sidecars: String = pods
                    .iter()
                    .flatten()
                    .map(|p| {
                        format!(
                            "--- pod {}'s sidecar:\n{}{}",
                            p.index,
                            p.sidecar.log(),
                            board_listing(&p.root)
                        )
                    })
                    .collect();
                panic!(
                    "more failures than expected:\n{}\n--- pod {i}'s stopped sidecar:\n{}{sidecars}",
                    job.dump(),
                    old_log
                );
            }
            replaced += 1;
            // The operator: the same pod, the next incarnation.
            if let Some(delay) = node_loss.filter(|_| inc == 1) {
                std::thread::sleep(delay);
            }
            pods[i] = Some(job.start_pod(i, inc));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let outs = pods
        .iter()
        .map(|p| p.as_ref().unwrap().out.lock().unwrap().clone())
        .collect();
    (outs, replaced)
}

fn final_weights(job: &Job, outs: &[String]) -> String {
    let ws: Vec<String> = outs
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let f = facts(o);
            let last = |e: &str| f.iter().rev().find(|m| m["event"] == e).cloned();
            let steps = last("steps")
                .unwrap_or_else(|| panic!("pod {i} printed no step count:\n{}", job.dump()));
            assert_eq!(
                steps["steps"],
                STEPS.to_string(),
                "pod {i}:\n{}",
                job.dump()
            );
            assert_eq!(
                steps["size"],
                job.n.to_string(),
                "pod {i} ended short:\n{}",
                job.dump()
            );
            last("final").unwrap()["w"].clone()
        })
        .collect();
    assert!(
        ws.windows(2).all(|p| p[0] == p[1]),
        "pods disagree:\n{}",
        job.dump()
    );
    ws[0].clone()
}

/// A scenario of `rank-worker train` on `n` pods; returns (kill -> every
/// survivor computing again, kill -> full size) in ms.
fn scenario(n: usize, name: &str, victim: usize, step: u64, replacements: usize) -> (u128, u128) {
    scenario_with(n, name, victim, step, replacements, None, "host")
}

fn scenario_with(
    n: usize,
    name: &str,
    victim: usize,
    step: u64,
    replacements: usize,
    node_loss: Option<Duration>,
    memory: &str,
) -> (u128, u128) {
    // The reference also warms the GPU kernel cache (with no operation
    // timeout: a first compilation may take longer than the scenario's).
    let mut reference = Job::new(
        n,
        vec![
            STEPS.to_string(),
            "none".into(),
            "0".into(),
            "0".into(),
            memory.to_string(),
        ],
    );
    reference.timeout_ms = "0";
    let (outs, r) = run(&mut reference, 0, None);
    assert_eq!(r, 0);
    let want = final_weights(&reference, &outs);
    drop(reference);

    let args = vec![
        STEPS.to_string(),
        name.to_string(),
        victim.to_string(),
        step.to_string(),
        memory.to_string(),
    ];
    let mut job = Job::new(n, args);
    let (outs, replaced) = run(&mut job, replacements, node_loss);
    assert_eq!(replaced, replacements, "{}", job.dump());
    assert_eq!(
        final_weights(&job, &outs),
        want,
        "{name}: the weights differ from the run without failure:\n{}",
        job.dump()
    );
    let all: Vec<BTreeMap<String, String>> = job
        .logs
        .iter()
        .flatten()
        .flat_map(|o| facts(&o.lock().unwrap()))
        .collect();
    let t = |e: &str| -> Vec<u128> {
        all.iter()
            .filter(|m| m["event"] == e)
            .map(|m| m["t"].parse().unwrap())
            .collect()
    };
    let kill = *t("kill")
        .iter()
        .min()
        .unwrap_or_else(|| panic!("no kill:\n{}", job.dump()));
    // Each survivor's first shrink after the kill; the last of them.
    let shrunk = (0..n)
        .filter(|&i| i != victim)
        .filter_map(|i| {
            facts(&job.logs[i][0].lock().unwrap())
                .iter()
                .filter(|m| m["event"] == "shrunk")
                .map(|m| m["t"].parse::<u128>().unwrap())
                .min()
        })
        .max()
        .unwrap_or_else(|| panic!("no survivor shrank:\n{}", job.dump()));
    let grown = *t("grown")
        .iter()
        .max()
        .unwrap_or_else(|| panic!("no grow:\n{}", job.dump()));
    let name = match node_loss {
        Some(d) => format!("node loss (replacement after {d:?})"),
        None => name.to_string(),
    };
    let name = format!("{name} ({memory})");
    eprintln!(
        "pods: {name}, {n} pods, victim {victim} at step {step}: survivors computing again {} ms after the kill, full size after {} ms; {replaced} pod(s) replaced",
        shrunk.saturating_sub(kill),
        grown.saturating_sub(kill)
    );
    (shrunk.saturating_sub(kill), grown.saturating_sub(kill))
}

fn pick(n: usize) -> (usize, u64) {
    let s = common::seed();
    ((s % n as u64) as usize, 3 + (s / 7) % (STEPS - 10))
}

/// One pod's rank SIGKILLed: the survivors learn it from their sidecars,
/// shrink, go on; the replacement pod joins by grow through the relayed
/// board; the weights are those of a run without failure.
#[test]
fn a_pod_replaced_in_place_through_the_sidecars_board_relay() {
    let (victim, step) = pick(4);
    scenario(4, "kill", victim, step, 1);
}

/// Two pods lost one step apart, and a replacement that dies while it joins.
#[test]
fn two_pods_lost_and_a_replacement_dying_in_its_grow() {
    let (victim, step) = pick(4);
    scenario(4, "twice", victim, step, 2);
    scenario(4, "grow", (victim + 1) % 4, step, 2);
}

/// A frozen (SIGSTOPped) rank: a survivor's timeout reports it on the
/// board, the frozen rank's own sidecar SIGKILLs it, its pod is replaced.
#[test]
fn a_stopped_rank_is_killed_by_its_sidecar_and_its_pod_replaced() {
    let (victim, step) = pick(4);
    scenario(4, "stop", victim, step, 1);
}

/// A lost node: the pod's sidecar dies with its rank and tells nobody; the
/// other sidecars name the pod's ranks dead when its heartbeats stop
/// (`--peer-timeout-ms`, 3 s here), and the survivors shrink then; the
/// replacement comes 4 s after the loss.
#[test]
fn a_lost_node_is_named_dead_by_the_heartbeats() {
    let (victim, step) = pick(4);
    let (computing, _) = scenario_with(
        4,
        "stop",
        victim,
        step,
        1,
        Some(Duration::from_secs(4)),
        "host",
    );
    assert!(
        computing >= 2500,
        "the survivors shrank after {computing} ms: before the heartbeat timeout, so not through it"
    );
}

/// A lost node whose replacement answers before the heartbeats time out:
/// the new incarnation behind the same address names the old one dead.
#[test]
fn a_lost_node_replaced_at_once_is_named_dead_by_its_replacement() {
    let (victim, step) = pick(4);
    let (computing, _) = scenario_with(4, "stop", victim, step, 1, Some(Duration::ZERO), "host");
    assert!(
        computing < 2500,
        "{computing} ms: not through the replacement's incarnation"
    );
}

// On the GPU machine (ranks share device 0; gradients all-reduced in device
// memory): cargo test -p weft-tests --test recovery_pods -- --ignored --nocapture

/// A pod's rank SIGKILLed, gradients in device memory.
#[test]
#[ignore = "needs a CUDA GPU (ranks share device 0)"]
fn gpu_a_pod_replaced_in_place_device_buffers() {
    let (victim, step) = pick(4);
    scenario_with(4, "kill", victim, step, 1, None, "device");
}

/// A lost node (sidecar and rank gone silently), device memory.
#[test]
#[ignore = "needs a CUDA GPU (ranks share device 0)"]
fn gpu_a_lost_node_device_buffers() {
    let (victim, step) = pick(4);
    scenario_with(
        4,
        "stop",
        victim,
        step,
        1,
        Some(Duration::from_secs(4)),
        "device",
    );
}
