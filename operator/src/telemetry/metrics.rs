//! Prometheus metrics of the reconciler (prometheus-client, text format).

use std::sync::atomic::AtomicI64;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub phase: String,
}

pub struct Metrics {
    pub registry: Registry,
    pub reconciles: Counter,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub reconcile_duration: Histogram,
    pub job_restarts: Counter,
    pub rank_replacements: Counter,
    pub phase_transitions: Family<PhaseLabels, Counter>,
    pub pods_created: Counter,
    pub pods_deleted: Counter,
    pub leader: Gauge<i64, AtomicI64>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("weft_operator");
        let reconciles = Counter::default();
        let reconcile_errors = Family::<ErrorLabels, Counter>::default();
        // 1 ms .. ~16 s: a reconcile is a handful of API calls.
        let reconcile_duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        let job_restarts = Counter::default();
        let rank_replacements = Counter::default();
        let phase_transitions = Family::<PhaseLabels, Counter>::default();
        let pods_created = Counter::default();
        let pods_deleted = Counter::default();
        let leader = Gauge::default();
        registry.register("reconciles", "Reconciliations run", reconciles.clone());
        registry.register(
            "reconcile_errors",
            "Reconciliations that failed, by error kind",
            reconcile_errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time spent in one reconciliation",
            reconcile_duration.clone(),
        );
        registry.register(
            "job_restarts",
            "Whole-job restarts after rank failures (every new epoch, also while Restarting)",
            job_restarts.clone(),
        );
        registry.register(
            "rank_replacements",
            "Failed pods replaced in place (onRankFailure: ReplaceRank)",
            rank_replacements.clone(),
        );
        registry.register(
            "job_phase_transitions",
            "CollectiveJob phase transitions, by new phase",
            phase_transitions.clone(),
        );
        registry.register("pods_created", "Pods created", pods_created.clone());
        registry.register("pods_deleted", "Pods deleted", pods_deleted.clone());
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease",
            leader.clone(),
        );
        Self {
            registry,
            reconciles,
            reconcile_errors,
            reconcile_duration,
            job_restarts,
            rank_replacements,
            phase_transitions,
            pods_created,
            pods_deleted,
            leader,
        }
    }
}

/// Observes the duration of a reconciliation when dropped.
pub struct ReconcileTimer<'a> {
    start: Instant,
    hist: &'a Histogram,
}

impl Drop for ReconcileTimer<'_> {
    fn drop(&mut self) {
        self.hist.observe(self.start.elapsed().as_secs_f64());
    }
}

impl Metrics {
    pub fn reconcile_started(&self) -> ReconcileTimer<'_> {
        self.reconciles.inc();
        ReconcileTimer {
            start: Instant::now(),
            hist: &self.reconcile_duration,
        }
    }

    pub fn reconcile_failed(&self, kind: &str) {
        self.reconcile_errors
            .get_or_create(&ErrorLabels { error: kind.into() })
            .inc();
    }

    /// Text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_registered_metrics() {
        let m = Metrics::default();
        drop(m.reconcile_started());
        m.reconcile_failed("kube");
        m.leader.set(1);
        let text = m.encode();
        for name in [
            "weft_operator_reconciles_total 1",
            "weft_operator_reconcile_errors_total{error=\"kube\"} 1",
            "weft_operator_reconcile_duration_seconds_count 1",
            "weft_operator_leader 1",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }
}
