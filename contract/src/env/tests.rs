use super::*;
use std::collections::HashMap;

fn lookup_of(vars: &[(&'static str, String)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    move |k| m.get(k).cloned()
}

use crate::test_table as table;

fn rank_env(rank: usize, secret: Option<&str>) -> RankEnv {
    RankEnv {
        rank,
        local_rank: rank,
        world_size: 4,
        local_ranks: 4,
        rank_offset: 0,
        nnodes: 1,
        node_rank: 0,
        bootstrap: "127.0.0.1:29400".into(),
        job: "local-1".into(),
        master_addr: "127.0.0.1".into(),
        master_port: 29500,
        secret: secret.map(str::to_string),
    }
}

#[test]
fn rank_vars_are_what_weft_run_always_set() {
    let v = rank_env(2, Some("s")).to_vars();
    let want: Vec<(&str, &str)> = vec![
        ("WEFT_RANK", "2"),
        ("WEFT_LOCAL_RANK", "2"),
        ("WEFT_WORLD_SIZE", "4"),
        ("WEFT_LOCAL_RANKS", "4"),
        ("WEFT_RANK_OFFSET", "0"),
        ("WEFT_NNODES", "1"),
        ("WEFT_NODE_RANK", "0"),
        ("WEFT_BOOTSTRAP", "127.0.0.1:29400"),
        ("NCCL_COMM_ID", "127.0.0.1:29400"),
        ("WEFT_JOB", "local-1"),
        ("RANK", "2"),
        ("LOCAL_RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("PET_NNODES", "1"),
        ("PET_NODE_RANK", "0"),
        ("PET_NPROC_PER_NODE", "4"),
        ("PET_MASTER_ADDR", "127.0.0.1"),
        ("PET_MASTER_PORT", "29500"),
        ("WEFT_JOB_SECRET", "s"),
    ];
    let got: Vec<(&str, &str)> = v.iter().map(|(k, v)| (*k, v.as_str())).collect();
    assert_eq!(got, want);
    assert!(
        !rank_env(0, None)
            .to_vars()
            .iter()
            .any(|(k, _)| *k == "WEFT_JOB_SECRET")
    );
}

#[test]
fn rank_env_round_trips() {
    for secret in [None, Some("xyz")] {
        let e = rank_env(3, secret);
        let back = RankEnv::from_lookup(&lookup_of(&e.to_vars())).unwrap();
        assert_eq!(back, e);
    }
}

#[test]
fn rank_env_errors_name_the_variable() {
    let mut v = rank_env(1, None).to_vars();
    v.retain(|(k, _)| *k != "WEFT_LOCAL_RANK" && *k != "LOCAL_RANK");
    let e = RankEnv::from_lookup(&lookup_of(&v)).unwrap_err();
    assert_eq!(e.to_string(), "WEFT_LOCAL_RANK (or LOCAL_RANK) is not set");
    let mut v = rank_env(1, None).to_vars();
    v.retain(|(k, _)| *k != "MASTER_PORT");
    v.push(("MASTER_PORT", "port".into()));
    let e = RankEnv::from_lookup(&lookup_of(&v)).unwrap_err();
    assert_eq!(e.to_string(), "MASTER_PORT=port: expected a port");
}

#[test]
fn rank_id_prefers_weft_names_and_falls_back_to_torch() {
    let id = RankId::from_lookup(&table(&[("RANK", "3"), ("WORLD_SIZE", "8")])).unwrap();
    assert_eq!(
        id,
        RankId {
            rank: 3,
            world_size: 8
        }
    );
    let id = RankId::from_lookup(&table(&[
        ("WEFT_RANK", " 1 "),
        ("RANK", "3"),
        ("WEFT_WORLD_SIZE", "2"),
        ("WORLD_SIZE", "8"),
    ]))
    .unwrap();
    assert_eq!(
        id,
        RankId {
            rank: 1,
            world_size: 2
        }
    );
    let e = RankId::from_lookup(&table(&[("WEFT_RANK", "1")])).unwrap_err();
    assert_eq!(
        e,
        EnvError::Missing {
            name: "WEFT_WORLD_SIZE",
            or: Some("WORLD_SIZE")
        }
    );
    assert_eq!(e.to_string(), "WEFT_WORLD_SIZE (or WORLD_SIZE) is not set");
    // A set but bad WEFT_RANK is an error, not a fallback.
    let e = RankId::from_lookup(&table(&[
        ("WEFT_RANK", "x"),
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
    ]))
    .unwrap_err();
    assert_eq!(e.to_string(), "WEFT_RANK=x: expected a whole number");
}

fn pod_env(net_if: Option<&str>, otlp: Option<&str>) -> PodEnv {
    PodEnv {
        job: "shape".into(),
        namespace: "ml".into(),
        world_size: 6,
        rank_offset: 2,
        local_ranks: 2,
        nnodes: 3,
        node_rank: 1,
        bootstrap: "shape-0.shape.ml.svc:29400".into(),
        sidecar_socket: "/run/weft/sidecar.sock".into(),
        secret_file: "/etc/weft/secret/token".into(),
        restart_epoch: 7,
        incarnation: 2,
        recovery_dir: net_if.map(|_| "/run/weft/board".to_string()),
        transport: "auto".into(),
        net_if: net_if.map(str::to_string),
        otlp_endpoint: otlp.map(str::to_string),
        torch: TorchRunEnv {
            nnodes: 3,
            node_rank: 1,
            nproc_per_node: 2,
            master_addr: "shape-0.shape.ml.svc".into(),
            master_port: 29500,
        },
    }
}

#[test]
fn pod_vars_in_the_operator_order() {
    let v = pod_env(Some("ib0"), Some("http://otel:4317")).to_vars();
    let names: Vec<&str> = v.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        names,
        [
            "WEFT_JOB",
            "WEFT_JOB_NAMESPACE",
            "WEFT_WORLD_SIZE",
            "WEFT_RANK_OFFSET",
            "WEFT_LOCAL_RANKS",
            "WEFT_NNODES",
            "WEFT_NODE_RANK",
            "WEFT_BOOTSTRAP",
            "WEFT_SIDECAR_SOCKET",
            "WEFT_JOB_SECRET_FILE",
            "WEFT_RESTART_EPOCH",
            "WEFT_INCARNATION",
            "WEFT_TRANSPORT",
            "WEFT_NET_IF",
            "WEFT_RECOVERY_DIR",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "PET_NNODES",
            "PET_NODE_RANK",
            "PET_NPROC_PER_NODE",
            "PET_MASTER_ADDR",
            "PET_MASTER_PORT",
        ]
    );
    let plain = pod_env(None, None).to_vars();
    assert!(
        !plain.iter().any(|(k, _)| *k == "WEFT_NET_IF"
            || *k == "WEFT_RECOVERY_DIR"
            || k.starts_with("OTEL_"))
    );
}

#[test]
fn pod_env_round_trips() {
    for (i, o) in [(None, None), (Some("eth1"), Some("http://c:4317"))] {
        let e = pod_env(i, o);
        assert_eq!(PodEnv::from_lookup(&lookup_of(&e.to_vars())).unwrap(), e);
    }
}

#[test]
fn bootstrap_env() {
    let b = BootstrapEnv::from_lookup(&table(&[
        ("WEFT_BOOTSTRAP", "  "),
        ("NCCL_COMM_ID", "h:1"),
        ("WEFT_JOB", "j"),
    ]))
    .unwrap();
    assert_eq!(b.addr, "h:1");
    assert_eq!(b.job, "j");
    assert_eq!(b.restart_epoch, "");
    assert_eq!(b.secret, None);
    assert!(!BootstrapEnv::is_set_in(&table(&[("NCCL_COMM_ID", "")])));
    let e = BootstrapEnv::from_lookup(&table(&[])).unwrap_err();
    assert_eq!(e.to_string(), "WEFT_BOOTSTRAP (or NCCL_COMM_ID) is not set");
}

#[test]
fn secret_source_precedence() {
    let s = |v: &[(&str, &str)]| SecretSource::from_lookup(&table(v));
    assert_eq!(
        s(&[("WEFT_JOB_SECRET", "a"), ("WEFT_JOB_SECRET_FILE", "/f")]),
        Some(SecretSource::Inline("a".into()))
    );
    assert_eq!(
        s(&[("WEFT_JOB_SECRET", ""), ("WEFT_JOB_SECRET_FILE", "/f")]),
        Some(SecretSource::File("/f".into()))
    );
    assert_eq!(s(&[("WEFT_JOB_SECRET", "")]), None);
    let dir = std::env::temp_dir().join(format!("weft-contract-secret-{}", std::process::id()));
    std::fs::write(&dir, " tok\n").unwrap();
    let f = SecretSource::File(dir.to_string_lossy().into_owned());
    assert_eq!(f.read().unwrap(), "tok");
    std::fs::remove_file(&dir).unwrap();
    assert!(f.read().is_err());
}

/// Which variable asks for span export, as OTel reads them (the traces
/// endpoint first; empty is unset; OTEL_SDK_DISABLED=true turns it off).
#[test]
fn the_otlp_endpoint_is_read_as_otel_does() {
    let e = |v: &[(&str, &str)]| otlp_endpoint_from(&table(v));
    assert_eq!(
        e(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317")]),
        Some(("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317".into()))
    );
    assert_eq!(e(&[]), None);
    assert_eq!(e(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "")]), None);
    assert_eq!(
        e(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_SDK_DISABLED", "TRUE"),
        ]),
        None
    );
    assert_eq!(
        e(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_SDK_DISABLED", "false"),
        ]),
        Some(("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317".into()))
    );
    assert_eq!(
        e(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:4317"),
        ]),
        Some(("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://t:4317".into()))
    );
}

#[test]
fn every_weft_contract_name_is_declared() {
    for n in names::ALL {
        if n.starts_with("WEFT_") || n.starts_with("NCCL_") || n.starts_with("OTEL_") {
            assert!(crate::params::find(n).is_some(), "{n} is not declared");
        }
    }
}
