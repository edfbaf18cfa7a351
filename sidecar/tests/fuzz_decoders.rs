//! Bounded fuzzing (proptest) of what the sidecar decodes from the wire: any
//! bytes either decode or fail cleanly (never panic, never allocate beyond
//! the input), and any decodable message sequence, fed to the engine, leaves
//! a consistent, bounded snapshot.

use proptest::prelude::*;
use prost::Message;
use weft::engine::Engine;
use weft::engine::liveness::Liveness;
use weft::rpc::{self, rank_message::Msg};

fn cfg() -> ProptestConfig {
    // Bounded for CI: a few seconds.
    ProptestConfig {
        cases: 512,
        ..ProptestConfig::default()
    }
}

fn arb_msg() -> impl Strategy<Value = Msg> {
    let s = || "[a-z0-9]{0,8}";
    prop_oneof![
        (s(), 0u32..8, 0u32..8, any::<u32>(), any::<u32>()).prop_map(|(c, r, n, slot, g)| {
            Msg::Register(rpc::Register {
                comm_id: c,
                rank: r,
                nranks: n,
                slot,
                slot_generation: g,
            })
        }),
        (s(), 0u32..8).prop_map(|(c, r)| Msg::Deregister(rpc::Deregister {
            comm_id: c,
            rank: r
        })),
        (s(), 0u32..8, 0u64..5, 0i32..4, s()).prop_map(|(c, r, seq, ph, op)| Msg::Op(
            rpc::OpEvent {
                comm_id: c,
                rank: r,
                seq,
                phase: ph,
                op,
                ..Default::default()
            }
        )),
        (s(), 0u32..8, ".{0,64}").prop_map(|(c, r, e)| Msg::Error(rpc::AsyncError {
            comm_id: c,
            rank: r,
            error: e
        })),
        (s(), 0u32..8, s()).prop_map(|(c, r, st)| Msg::State(rpc::CommStateChange {
            comm_id: c,
            rank: r,
            state: st
        })),
    ]
}

proptest! {
    #![proptest_config(cfg())]

    #[test]
    fn arbitrary_bytes_never_panic_the_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = rpc::RankMessage::decode(bytes.as_slice());
        let _ = rpc::Status::decode(bytes.as_slice());
        let _ = rpc::SidecarCommand::decode(bytes.as_slice());
        let _ = rpc::Hello::decode(bytes.as_slice());
    }

    #[test]
    fn mutated_valid_messages_never_panic(m in arb_msg(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8)) {
        let mut b = rpc::RankMessage { msg: Some(m) }.encode_to_vec();
        for (i, x) in flips {
            if !b.is_empty() {
                let n = b.len();
                b[i % n] ^= x;
            }
        }
        if let Ok(r) = rpc::RankMessage::decode(b.as_slice()) {
            let e = Engine::new("j".into(), "h".into(), None);
            let (tx, _rx) = tokio::sync::mpsc::channel(4);
            let conn = e.add_proc(rpc::Hello::default(), None, tx, None, Liveness::Unknown);
            if let Some(m) = r.msg { e.on_message(conn, m) }
        }
    }

    #[test]
    fn any_message_sequence_leaves_a_consistent_snapshot(ms in proptest::collection::vec(arb_msg(), 0..64)) {
        let e = Engine::new("j".into(), "h".into(), None);
        let (tx, _rx) = tokio::sync::mpsc::channel(4);
        let conn = e.add_proc(rpc::Hello { pid: 7, ..Default::default() }, None, tx, None, Liveness::Unknown);
        let mut last = e.state.snapshot().snapshot_seq;
        for m in ms {
            e.on_message(conn, m);
            let s = e.state.snapshot();
            prop_assert!(s.snapshot_seq >= last);
            last = s.snapshot_seq;
            for c in &s.comms {
                prop_assert!(c.ranks.iter().all(|r| r.pid == 7));
                prop_assert!(c.missing.len() <= c.nranks as usize);
            }
            prop_assert!(s.async_errors.len() <= 256);
        }
    }
}

// The network proxy's decoders: rank opens (libcomm::sidecar_link), message
// headers on the ranks' socket, sidecar-to-sidecar handshake and frames.
fn valid_open() -> libcomm::sidecar_link::OpenMsg {
    use libcomm::sidecar_link::{OpenMsg, ProxyPeer};
    OpenMsg {
        job: "job".into(),
        comm: [3; 16],
        rank: 1,
        nranks: 4,
        pid: 42,
        ring_cap: 1 << 16,
        addr: "10.0.0.1:5".parse().unwrap(),
        peers: vec![ProxyPeer {
            rank: 2,
            addr: "10.0.0.2:6".parse().unwrap(),
            host: "h2".into(),
        }],
    }
}

proptest! {
    #![proptest_config(cfg())]

    #[test]
    fn arbitrary_bytes_never_panic_the_proxy_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        use weft::proxy::wire;
        let _ = libcomm::sidecar_link::OpenMsg::decode(&bytes);
        let mut h = [0u8; libcomm::sidecar_link::HEADER];
        let n = bytes.len().min(h.len());
        h[..n].copy_from_slice(&bytes[..n]);
        let _ = libcomm::sidecar_link::decode_header(&h);
        let mut f = [0u8; wire::FRAME_HEADER];
        let n = bytes.len().min(f.len());
        f[..n].copy_from_slice(&bytes[..n]);
        if let Ok(fr) = wire::Frame::decode(&f) {
            // Whatever decodes is within the bounds the receive loop relies on.
            if fr.kind == wire::KIND_DATA {
                prop_assert!(fr.len as usize <= wire::MAX_FRAME && fr.len % 8 == 0);
            } else {
                prop_assert!(fr.len as usize <= wire::MAX_REASON);
            }
        }
        let _ = wire::Hello::decode(&bytes);
        let _ = wire::Challenge::decode(&bytes);
        let _ = wire::decode_proof(&bytes);
    }

    #[test]
    fn mutated_proxy_messages_never_panic(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let mut b = valid_open().encode();
        for (i, x) in &flips {
            let k = i % b.len();
            b[k] ^= x;
        }
        if let Ok(m) = libcomm::sidecar_link::OpenMsg::decode(&b) {
            prop_assert!(m.rank < m.nranks && m.peers.iter().all(|p| p.rank < m.nranks));
            prop_assert!((m.ring_cap as usize).is_power_of_two());
        }
        let f = weft::proxy::wire::Frame { kind: 1, key: ([1; 16], 1, 2), len: 4096, value: 64 };
        let mut h = f.encode();
        for (i, x) in &flips {
            h[i % h.len()] ^= x;
        }
        if let Ok(fr) = weft::proxy::wire::Frame::decode(&h) {
            prop_assert!(fr.len as usize <= weft::proxy::wire::MAX_FRAME);
        }
    }
}

#[test]
fn proxy_open_round_trips_and_oversized_input_is_refused() {
    let m = valid_open();
    assert_eq!(
        libcomm::sidecar_link::OpenMsg::decode(&m.encode()).unwrap(),
        m
    );
    assert!(
        libcomm::sidecar_link::OpenMsg::decode(&vec![0u8; libcomm::sidecar_link::MAX_MSG + 1])
            .is_err()
    );
    let mut h = [0u8; libcomm::sidecar_link::HEADER];
    h[..4].copy_from_slice(&libcomm::sidecar_link::MAGIC);
    h[4] = libcomm::sidecar_link::VERSION;
    h[5] = libcomm::sidecar_link::KIND_OPEN;
    h[8..].copy_from_slice(&(libcomm::sidecar_link::MAX_MSG as u32 + 1).to_be_bytes());
    assert!(libcomm::sidecar_link::decode_header(&h).is_err());
}

#[test]
fn the_decoder_refuses_messages_over_the_limit() {
    // The gRPC server is built with max_decoding_message_size(MAX_MESSAGE);
    // this keeps the limit itself honest.
    const { assert!(weft::engine::MAX_MESSAGE <= 1 << 20) };
}
