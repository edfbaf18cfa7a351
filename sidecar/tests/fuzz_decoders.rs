//! Bounded fuzzing (proptest) of what the sidecar decodes from the wire: any
//! bytes either decode or fail cleanly (never panic, never allocate beyond
//! the input), and any decodable message sequence, fed to the engine, leaves
//! a consistent, bounded snapshot.

use proptest::prelude::*;
use prost::Message;
use weft::engine::Engine;
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
        (s(), 0u32..8, 0u32..8).prop_map(|(c, r, n)| Msg::Register(rpc::Register {
            comm_id: c,
            rank: r,
            nranks: n
        })),
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
            let conn = e.add_proc(rpc::Hello::default(), tx);
            if let Some(m) = r.msg { e.on_message(conn, m) }
        }
    }

    #[test]
    fn any_message_sequence_leaves_a_consistent_snapshot(ms in proptest::collection::vec(arb_msg(), 0..64)) {
        let e = Engine::new("j".into(), "h".into(), None);
        let (tx, _rx) = tokio::sync::mpsc::channel(4);
        let conn = e.add_proc(rpc::Hello { pid: 7, ..Default::default() }, tx);
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

#[test]
fn the_decoder_refuses_messages_over_the_limit() {
    // The gRPC server is built with max_decoding_message_size(MAX_MESSAGE);
    // this keeps the limit itself honest.
    const { assert!(weft::engine::MAX_MESSAGE <= 1 << 20) };
}
