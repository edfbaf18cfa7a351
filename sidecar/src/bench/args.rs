//! `weft bench` arguments (nccl-tests' option letters where they fit) and
//! their round trip to the hidden per-rank `weft bench-rank` command.

use std::ffi::OsString;
use std::time::Duration;

use clap::{Args, ValueEnum};
use libcomm::{DataType, ReduceOp};

use super::ops::BenchOp;
use super::sizes::parse_size;

pub const HELP: &str = "\
Prints nccl-tests' table: for each size, the time of one call (average over
--iters calls after -w warm-up calls, averaged over ranks), algbw = size/time
and busbw = algbw x factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter,
alltoall (n-1)/n; broadcast, reduce, sendrecv 1), out of place and in place.
Sizes follow nccl-tests: all_gather's size is the gathered output,
reduce_scatter's the input, alltoall's one rank's whole buffer.

--check fills the buffers with random data before one extra checked call per
size and placement and compares every element with a host reference (#wrong).

Exit status: 0 on success; 1 when a result was wrong or a rank failed; 2 for
bad arguments; 124 on --timeout.";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// Host memory.
    Host,
    /// CUDA device memory: rank i uses GPU (local rank mod GPU count), work
    /// on one stream per rank, timed until the stream drains.
    Cuda,
}

/// `weft bench OP -n N [-b MIN -e MAX -f FACTOR] [--dtype T] [--op O] [--check] ...`
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// all_reduce, all_gather, reduce_scatter, broadcast, reduce, alltoall or
    /// sendrecv (nccl-tests' spellings work too: allreduce, all_reduce_perf, ...).
    #[arg(value_name = "OP", value_parser = parse_op)]
    pub coll: BenchOp,
    /// Number of ranks, all started on this machine [default: 2]; in a pod
    /// of a CollectiveJob, or as a rank a launcher started, the job's world
    /// size (WEFT_WORLD_SIZE), which -n may only repeat.
    #[arg(short = 'n', long = "nranks", visible_alias = "ranks", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub nranks: Option<u32>,
    /// Smallest size in bytes (K, M, G suffixes: powers of 1024).
    #[arg(short = 'b', long = "minbytes", value_name = "SIZE", default_value = "8",
          value_parser = parse_size)]
    pub min_bytes: u64,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", value_name = "SIZE", default_value = "32M",
          value_parser = parse_size)]
    pub max_bytes: u64,
    /// Multiply the size by this much from one line to the next.
    #[arg(short = 'f', long = "stepfactor", value_name = "FACTOR", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(2..))]
    pub factor: u64,
    /// Warm-up calls before timing each size and placement.
    #[arg(
        short = 'w',
        long = "warmup_iters",
        visible_alias = "warmup-iters",
        value_name = "N",
        default_value_t = 5
    )]
    pub warmup: u32,
    /// Timed calls per size and placement.
    #[arg(short = 'i', long = "iters", value_name = "N", default_value_t = 20,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub iters: u32,
    /// Element type: float, half, bfloat16, double, int8, uint8, int32, uint32,
    /// int64, uint64, f8e4m3, f8e5m2.
    #[arg(short = 'd', long = "dtype", value_name = "TYPE", default_value = "float",
          value_parser = parse_dtype)]
    pub dtype: DataType,
    /// Reduction: sum, prod, max, min, avg.
    #[arg(short = 'o', long = "op", value_name = "REDOP", default_value = "sum",
          value_parser = parse_redop)]
    pub redop: ReduceOp,
    /// Root rank of broadcast and reduce.
    #[arg(short = 'r', long = "root", value_name = "RANK", default_value_t = 0)]
    pub root: u32,
    /// Check every result on random data against a host reference (#wrong).
    #[arg(short = 'c', long = "check")]
    pub check: bool,
    /// Memory the buffers live in.
    #[arg(long = "device", value_enum, default_value_t = Device::Host)]
    pub device: Device,
    /// Algorithm override for the ranks (sets WEFT_ALGO), e.g. ring, rd,
    /// tree, direct, pairwise, or allreduce:ring,broadcast:tree.
    #[arg(short = 'a', long = "algo", value_name = "ALGO")]
    pub algo: Option<String>,
    /// Print one JSON document instead of the table.
    #[arg(long = "json")]
    pub json: bool,
    /// Stop every rank and exit 124 when the benchmark runs longer than this.
    #[arg(long = "timeout", value_name = "SECS", value_parser = crate::arg_values::parse_secs)]
    pub timeout: Option<Duration>,
}

fn parse_op(s: &str) -> Result<BenchOp, String> {
    s.parse()
}

fn parse_dtype(s: &str) -> Result<DataType, String> {
    s.parse::<DataType>().map_err(|e| e.to_string())
}

fn parse_redop(s: &str) -> Result<ReduceOp, String> {
    match s.parse::<ReduceOp>().map_err(|e| e.to_string())? {
        ReduceOp::PreMulSum(_) => Err("premulsum is not supported by weft bench".into()),
        op => Ok(op),
    }
}

impl BenchArgs {
    /// Checks what clap cannot: consistency between options.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_bytes > self.max_bytes {
            return Err(format!(
                "invalid sizes: minbytes {} > maxbytes {}",
                self.min_bytes, self.max_bytes
            ));
        }
        let nranks = self.nranks.unwrap_or(super::placement::DEFAULT_RANKS);
        if self.root >= nranks {
            return Err(format!(
                "--root {} is out of range for {nranks} ranks",
                self.root
            ));
        }
        if let Some(a) = &self.algo {
            a.parse::<libcomm::AlgoOverride>()
                .map_err(|e| format!("--algo {a}: {e}"))?;
        }
        // Both buffers of the largest size must be addressable.
        let largest = self
            .coll
            .layout(self.max_bytes, self.dtype, nranks as usize)
            .buffer_elems();
        if largest.checked_mul(self.dtype.size() * 2).is_none() {
            return Err(format!("--maxbytes {} is too large", self.max_bytes));
        }
        Ok(())
    }

    /// The arguments of the hidden per-rank command that runs these options.
    pub fn to_rank_argv(&self) -> Vec<OsString> {
        let mut v: Vec<String> = vec![
            "bench-rank".into(),
            self.coll.name().into(),
            "-b".into(),
            self.min_bytes.to_string(),
            "-e".into(),
            self.max_bytes.to_string(),
            "-f".into(),
            self.factor.to_string(),
            "-w".into(),
            self.warmup.to_string(),
            "-i".into(),
            self.iters.to_string(),
            "-d".into(),
            self.dtype.name().into(),
            "-o".into(),
            self.redop.name().into(),
            "-r".into(),
            self.root.to_string(),
        ];
        if let Some(n) = self.nranks {
            v.push("-n".into());
            v.push(n.to_string());
        }
        if self.check {
            v.push("--check".into());
        }
        if self.json {
            v.push("--json".into());
        }
        if let Some(a) = &self.algo {
            v.push("--algo".into());
            v.push(a.clone());
        }
        if self.device == Device::Cuda {
            v.push("--device".into());
            v.push("cuda".into());
        }
        v.into_iter().map(OsString::from).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: BenchArgs,
    }

    fn parse(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        T::try_parse_from(std::iter::once("t").chain(args.iter().copied())).map(|t| t.a)
    }

    #[test]
    fn defaults() {
        let a = parse(&["allreduce"]).unwrap();
        assert_eq!(a.coll, BenchOp::AllReduce);
        assert_eq!(
            (a.nranks, a.min_bytes, a.max_bytes, a.factor),
            (None, 8, 32 << 20, 2)
        );
        assert_eq!((a.warmup, a.iters, a.root), (5, 20, 0));
        assert_eq!(a.dtype, DataType::F32);
        assert_eq!(a.redop, ReduceOp::Sum);
        assert!(!a.check && !a.json);
        assert_eq!(a.device, Device::Host);
        a.validate().unwrap();
    }

    #[test]
    fn nccl_tests_style_options() {
        let a = parse(&[
            "all_gather",
            "-n",
            "3",
            "-b",
            "8",
            "-e",
            "64K",
            "-f",
            "8",
            "-d",
            "half",
            "-o",
            "max",
            "-c",
            "-w",
            "1",
            "-i",
            "3",
            "-a",
            "ring",
        ])
        .unwrap();
        assert_eq!(a.coll, BenchOp::AllGather);
        assert_eq!(
            (a.nranks, a.min_bytes, a.max_bytes, a.factor),
            (Some(3), 8, 65536, 8)
        );
        assert_eq!(a.dtype, DataType::F16);
        assert_eq!(a.redop, ReduceOp::Max);
        assert!(a.check);
        assert_eq!(a.algo.as_deref(), Some("ring"));
        let b = parse(&[
            "reduce", "--dtype", "bf16", "--op", "avg", "--root", "1", "-n", "2",
        ])
        .unwrap();
        assert_eq!(
            (b.dtype, b.redop, b.root),
            (DataType::Bf16, ReduceOp::Avg, 1)
        );
    }

    #[test]
    fn rejects_bad_input() {
        assert!(parse(&["allreduc"]).is_err());
        assert!(parse(&["allreduce", "-n", "0"]).is_err());
        assert!(parse(&["allreduce", "-f", "1"]).is_err());
        assert!(parse(&["allreduce", "-i", "0"]).is_err());
        assert!(parse(&["allreduce", "-d", "quad"]).is_err());
        assert!(parse(&["allreduce", "-o", "premulsum:2"]).is_err());
        assert!(
            parse(&["allreduce", "-b", "1M", "-e", "1K"])
                .unwrap()
                .validate()
                .is_err()
        );
        assert!(
            parse(&["reduce", "-n", "2", "-r", "2"])
                .unwrap()
                .validate()
                .is_err()
        );
        assert!(
            parse(&["allreduce", "-a", "warp"])
                .unwrap()
                .validate()
                .is_err()
        );
        assert_eq!(
            parse(&["allreduce", "--device", "cuda"]).unwrap().device,
            Device::Cuda
        );
    }

    #[test]
    fn rank_argv_round_trips() {
        let a = parse(&[
            "bcast", "-n", "4", "-b", "1K", "-e", "1M", "-f", "4", "-d", "int8", "-o", "min", "-r",
            "3", "-c", "--json", "-w", "2", "-i", "7", "-a", "tree", "--device", "cuda",
        ])
        .unwrap();
        let argv = a.to_rank_argv();
        assert_eq!(argv[0], "bench-rank");
        let rest: Vec<String> = argv[1..]
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        let refs: Vec<&str> = rest.iter().map(String::as_str).collect();
        let b = parse(&refs).unwrap();
        assert_eq!(b.coll, a.coll);
        assert_eq!(
            (
                b.nranks,
                b.min_bytes,
                b.max_bytes,
                b.factor,
                b.warmup,
                b.iters,
                b.root
            ),
            (
                a.nranks,
                a.min_bytes,
                a.max_bytes,
                a.factor,
                a.warmup,
                a.iters,
                a.root
            )
        );
        assert_eq!(
            (b.dtype, b.redop, b.check, b.json),
            (a.dtype, a.redop, a.check, a.json)
        );
        assert_eq!(b.algo, a.algo);
        assert_eq!(b.device, Device::Cuda);
    }
}
