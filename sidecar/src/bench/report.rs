//! Output of `weft bench`: nccl-tests' table layout (same header lines, column
//! widths and number formatting) or one JSON document (`--json`).

use std::fmt::Write as _;

/// What the header describes.
#[derive(Debug, Clone)]
pub struct Header {
    pub op: &'static str,
    pub nranks: usize,
    pub min_bytes: u64,
    pub max_bytes: u64,
    pub factor: u64,
    pub warmup: u32,
    pub iters: u32,
    pub check: bool,
    pub device: &'static str,
    pub algo: Option<String>,
    /// (pid, host) of every rank, in rank order.
    pub ranks: Vec<(u32, String)>,
}

/// One placement's measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measure {
    /// Time of one call in microseconds (average over iterations, then ranks).
    pub time_us: f64,
    /// GB/s (10^9 bytes per second).
    pub algbw: f64,
    pub busbw: f64,
    /// Wrong elements summed over ranks; `None` without `--check` (`N/A`).
    pub wrong: Option<u64>,
}

/// One line of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub size: usize,
    pub count: usize,
    pub dtype: &'static str,
    pub redop: &'static str,
    pub root: i64,
    pub out_of_place: Measure,
    pub in_place: Measure,
}

/// nccl-tests' number formatting in a fixed width: two decimals if they fit,
/// then one, then none, then exponent notation.
pub fn fixed(value: f64, width: usize) -> String {
    for prec in [2, 1, 0] {
        let s = format!("{value:>width$.prec$}");
        if s.len() <= width {
            return s;
        }
    }
    let s = c_exp(value, if width >= 7 { 1 } else { 0 });
    format!("{s:>width$}")
}

/// C's `%.Ne`: `1.2e+07` rather than Rust's `1.2e7`.
fn c_exp(value: f64, prec: usize) -> String {
    let s = format!("{value:.prec$e}");
    match s.split_once('e') {
        Some((m, e)) => {
            let (sign, digits) = match e.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', e),
            };
            format!("{m}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// C's `%g` (6 significant digits, trailing zeros removed).
pub fn g(value: f64) -> String {
    if value == 0.0 || !value.is_finite() {
        return if value == 0.0 {
            "0".into()
        } else {
            value.to_string()
        };
    }
    let exp = value.abs().log10().floor() as i32;
    if (-4..6).contains(&exp) {
        let prec = (5 - exp).max(0) as usize;
        let s = format!("{value:.prec$}");
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    } else {
        let s = c_exp(value, 5);
        let (m, e) = s.split_once('e').unwrap();
        let m = if m.contains('.') {
            m.trim_end_matches('0').trim_end_matches('.')
        } else {
            m
        };
        format!("{m}e{e}")
    }
}

pub fn header(h: &Header) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# weft bench (nccl-tests format), weft {}, NCCL API {}",
        env!("CARGO_PKG_VERSION"),
        libcomm::NCCL_COMPAT_VERSION
    );
    let _ = writeln!(s, "# Collective test starting: {}", h.op);
    let _ = writeln!(
        s,
        "# nRanks {} minBytes {} maxBytes {} step: {}(factor) warmup iters: {} iters: {} validation: {} device: {} algo: {}",
        h.nranks,
        h.min_bytes,
        h.max_bytes,
        h.factor,
        h.warmup,
        h.iters,
        h.check as u8,
        h.device,
        h.algo.as_deref().unwrap_or("auto")
    );
    s.push_str("#\n# Using devices\n");
    for (rank, (pid, host)) in h.ranks.iter().enumerate() {
        let _ = writeln!(
            s,
            "#  Rank {rank:>2} Group  0 Pid {pid:>6} on {host:>10} device {}",
            h.device
        );
    }
    s.push_str("#\n");
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}           out-of-place                       in-place          ",
        "", "", "", "", ""
    );
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6} ",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "time",
        "algbw",
        "busbw",
        "#wrong"
    );
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6} ",
        "(B)",
        "(elements)",
        "",
        "",
        "",
        "(us)",
        "(GB/s)",
        "(GB/s)",
        "",
        "(us)",
        "(GB/s)",
        "(GB/s)",
        ""
    );
    s
}

fn measure(m: &Measure) -> String {
    let wrong = match m.wrong {
        Some(w) => format!("{:>6}", g(w as f64)),
        None => "   N/A".into(),
    };
    format!(
        "  {}  {}  {}  {wrong}",
        fixed(m.time_us, 7),
        fixed(m.algbw, 6),
        fixed(m.busbw, 6)
    )
}

pub fn row(r: &Row) -> String {
    format!(
        "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}{}{}\n",
        r.size,
        r.count,
        r.dtype,
        r.redop,
        r.root,
        measure(&r.out_of_place),
        measure(&r.in_place)
    )
}

/// Average bus bandwidth over every measurement, out of place and in place.
pub fn avg_busbw(rows: &[Row]) -> f64 {
    if rows.is_empty() {
        return 0.0;
    }
    rows.iter()
        .map(|r| r.out_of_place.busbw + r.in_place.busbw)
        .sum::<f64>()
        / (2 * rows.len()) as f64
}

pub fn total_wrong(rows: &[Row]) -> u64 {
    rows.iter()
        .map(|r| r.out_of_place.wrong.unwrap_or(0) + r.in_place.wrong.unwrap_or(0))
        .sum()
}

pub fn footer(op: &str, rows: &[Row]) -> String {
    let wrong = total_wrong(rows);
    format!(
        "# {:<20} : {} {}\n# {:<20} : {} \n#\n# Collective test concluded: {op}\n",
        "Out of bounds values",
        wrong,
        if wrong > 0 { "FAILED" } else { "OK" },
        "Avg bus bandwidth",
        g(avg_busbw(rows))
    )
}

fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn json_num(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        "null".into()
    }
}

fn json_measure(m: &Measure) -> String {
    format!(
        "{{\"time_us\": {}, \"algbw_gbps\": {}, \"busbw_gbps\": {}, \"wrong\": {}}}",
        json_num(m.time_us),
        json_num(m.algbw),
        json_num(m.busbw),
        m.wrong.map_or("null".into(), |w| w.to_string())
    )
}

/// The whole run as one JSON document.
pub fn json(h: &Header, dtype: &str, redop: &str, root: i64, rows: &[Row]) -> String {
    let mut s = String::from("{\n");
    let _ = writeln!(s, "  \"tool\": \"weft bench\",");
    let _ = writeln!(s, "  \"version\": {},", json_str(env!("CARGO_PKG_VERSION")));
    let _ = writeln!(s, "  \"op\": {},", json_str(h.op));
    let _ = writeln!(s, "  \"nranks\": {},", h.nranks);
    let _ = writeln!(s, "  \"dtype\": {},", json_str(dtype));
    let _ = writeln!(s, "  \"redop\": {},", json_str(redop));
    let _ = writeln!(s, "  \"root\": {root},");
    let _ = writeln!(s, "  \"min_bytes\": {},", h.min_bytes);
    let _ = writeln!(s, "  \"max_bytes\": {},", h.max_bytes);
    let _ = writeln!(s, "  \"step_factor\": {},", h.factor);
    let _ = writeln!(s, "  \"warmup_iters\": {},", h.warmup);
    let _ = writeln!(s, "  \"iters\": {},", h.iters);
    let _ = writeln!(s, "  \"check\": {},", h.check);
    let _ = writeln!(s, "  \"device\": {},", json_str(h.device));
    let _ = writeln!(
        s,
        "  \"algo\": {},",
        h.algo.as_deref().map_or("null".into(), json_str)
    );
    s.push_str("  \"results\": [");
    for (i, r) in rows.iter().enumerate() {
        let _ = write!(
            s,
            "{}\n    {{\"size\": {}, \"count\": {}, \"type\": {}, \"redop\": {}, \"root\": {}, \"out_of_place\": {}, \"in_place\": {}}}",
            if i == 0 { "" } else { "," },
            r.size,
            r.count,
            json_str(r.dtype),
            json_str(r.redop),
            r.root,
            json_measure(&r.out_of_place),
            json_measure(&r.in_place)
        );
    }
    s.push_str(if rows.is_empty() { "],\n" } else { "\n  ],\n" });
    let _ = writeln!(s, "  \"out_of_bounds\": {},", total_wrong(rows));
    let _ = writeln!(s, "  \"avg_busbw_gbps\": {}", json_num(avg_busbw(rows)));
    s.push_str("}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(t: f64, a: f64, b: f64, w: Option<u64>) -> Measure {
        Measure {
            time_us: t,
            algbw: a,
            busbw: b,
            wrong: w,
        }
    }

    #[test]
    fn fixed_width_numbers() {
        assert_eq!(fixed(12.3456, 7), "  12.35");
        assert_eq!(fixed(1234.5678, 7), "1234.57");
        assert_eq!(fixed(12345.678, 7), "12345.7");
        assert_eq!(fixed(123456.7, 7), " 123457");
        assert_eq!(fixed(12345678.0, 7), "1.2e+07");
        assert_eq!(fixed(0.0, 6), "  0.00");
        assert_eq!(fixed(999.994, 6), "999.99");
        assert_eq!(fixed(1234.5, 6), "1234.5");
        assert_eq!(fixed(1234567.0, 6), " 1e+06");
    }

    #[test]
    fn g_like_c() {
        assert_eq!(g(0.0), "0");
        assert_eq!(g(3.0), "3");
        assert_eq!(g(1.5), "1.5");
        assert_eq!(g(12.345678), "12.3457");
        assert_eq!(g(0.000123), "0.000123");
        assert_eq!(g(1234567.0), "1.23457e+06");
        assert_eq!(g(100000.0), "100000");
    }

    #[test]
    fn row_columns_line_up_with_the_header() {
        let h = Header {
            op: "all_reduce",
            nranks: 4,
            min_bytes: 8,
            max_bytes: 1024,
            factor: 2,
            warmup: 5,
            iters: 20,
            check: true,
            device: "host",
            algo: None,
            ranks: vec![(100, "h".into()); 4],
        };
        let head = header(&h);
        let lines: Vec<&str> = head.lines().collect();
        assert!(lines[0].starts_with("# weft bench"));
        assert_eq!(lines[1], "# Collective test starting: all_reduce");
        assert!(lines[2].contains("nRanks 4 minBytes 8 maxBytes 1024 step: 2(factor)"));
        assert_eq!(lines.iter().filter(|l| l.contains("#  Rank")).count(), 4);
        let names = lines[lines.len() - 2];
        let units = lines[lines.len() - 1];
        let r = row(&Row {
            size: 1048576,
            count: 262144,
            dtype: "float",
            redop: "sum",
            root: -1,
            out_of_place: m(123.45, 8.49, 12.74, Some(0)),
            in_place: m(120.0, 8.74, 13.11, Some(0)),
        });
        assert_eq!(
            r,
            "     1048576        262144     float     sum      -1   123.45    8.49   12.74       0   120.00    8.74   13.11       0\n"
        );
        // Every column's right edge matches the header's.
        let ends = |s: &str| -> Vec<usize> {
            let b = s.as_bytes();
            (0..b.len())
                .filter(|&i| b[i] != b' ' && (i + 1 == b.len() || b[i + 1] == b' '))
                .collect()
        };
        assert_eq!(ends(names.trim_end())[1..], ends(r.trim_end())[..]);
        assert!(units.contains("(elements)"));
        let na = row(&Row {
            size: 8,
            count: 2,
            dtype: "float",
            redop: "none",
            root: 0,
            out_of_place: m(5.0, 0.0, 0.0, None),
            in_place: m(5.0, 0.0, 0.0, None),
        });
        assert!(na.trim_end().ends_with("N/A"));
        assert_eq!(na.len(), r.len());
    }

    #[test]
    fn footer_and_average() {
        let rows = vec![Row {
            size: 8,
            count: 2,
            dtype: "float",
            redop: "sum",
            root: -1,
            out_of_place: m(1.0, 1.0, 1.0, Some(0)),
            in_place: m(1.0, 1.0, 2.0, Some(3)),
        }];
        assert_eq!(avg_busbw(&rows), 1.5);
        assert_eq!(total_wrong(&rows), 3);
        let f = footer("all_reduce", &rows);
        assert!(
            f.starts_with("# Out of bounds values : 3 FAILED\n# Avg bus bandwidth    : 1.5 \n")
        );
        assert!(f.ends_with("# Collective test concluded: all_reduce\n"));
        let h = Header {
            op: "all_reduce",
            nranks: 1,
            min_bytes: 8,
            max_bytes: 8,
            factor: 2,
            warmup: 1,
            iters: 1,
            check: true,
            device: "host",
            algo: Some("ring".into()),
            ranks: vec![],
        };
        let j = json(&h, "float", "sum", -1, &rows);
        assert!(j.contains("\"algo\": \"ring\""));
        assert!(j.contains("\"out_of_bounds\": 3"));
        assert!(j.contains(
            "\"in_place\": {\"time_us\": 1, \"algbw_gbps\": 1, \"busbw_gbps\": 2, \"wrong\": 3}"
        ));
    }
}
