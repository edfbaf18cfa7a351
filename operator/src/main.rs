//! `weft-operator`: runs the CollectiveJob controller, or prints the CRD.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use clap::{Parser, Subcommand};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use tracing::{error, info};
use weft_contract::params;
use weft_operator::controller::{self, Context};
use weft_operator::crd::CollectiveJob;
use weft_operator::leader::{self, LeaseConfig};
use weft_operator::resources::OperatorConfig;
use weft_operator::telemetry::http::{self, HttpState, Readiness};
use weft_operator::telemetry::metrics::Metrics;
use weft_operator::uninstall::{self, UninstallConfig};

#[derive(Parser)]
#[command(
    name = "weft-operator",
    version,
    about = "Kubernetes operator for Weft CollectiveJobs"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Print the CollectiveJob CRD as YAML (crds/collectivejob.yaml).
    Crd,
    /// Run the controller (the default).
    Run(RunArgs),
    /// Print the Service, Secret and Pods the operator would create for the
    /// CollectiveJobs in a manifest (a dry run; "-" reads stdin).
    Render {
        /// Manifest file with one or more CollectiveJobs (other kinds are skipped).
        file: String,
        /// Namespace for jobs that name none.
        #[arg(long, default_value = "default")]
        namespace: String,
        /// Sidecar image for jobs that do not name one.
        #[arg(
            long,
            env = params::WEFT_SIDECAR_IMAGE.name(),
            default_value = params::WEFT_SIDECAR_IMAGE.fixed_default()
        )]
        sidecar_image: String,
    },
    /// Before `helm uninstall` (the chart's pre-delete hook runs it): stop the
    /// operator, remove its finalizer from every CollectiveJob so that they can
    /// be deleted without an operator, and delete the leader Lease. The jobs
    /// and their pods keep running.
    Uninstall {
        /// The operator's namespace.
        #[arg(long, env = params::POD_NAMESPACE.name(), default_value = params::POD_NAMESPACE.fixed_default())]
        namespace: String,
        /// The operator's Deployment.
        #[arg(long)]
        deployment: String,
        /// How long to wait for the operator's pods to stop.
        #[arg(long, default_value_t = 120)]
        stop_timeout_secs: u64,
        #[command(flatten)]
        log: LogArgs,
    },
}

#[derive(clap::Args)]
struct LogArgs {
    /// Log filter (RUST_LOG syntax).
    #[arg(long, env = params::WEFT_LOG.name(), default_value = params::WEFT_LOG.fixed_default())]
    log_level: String,
    /// Log as JSON lines.
    #[arg(long, env = params::WEFT_LOG_JSON.name(), default_value = params::WEFT_LOG_JSON.fixed_default(), action = clap::ArgAction::Set)]
    log_json: bool,
}

impl LogArgs {
    fn init(&self) -> anyhow::Result<()> {
        let filter = tracing_subscriber::EnvFilter::try_new(&self.log_level)?;
        let fmt = tracing_subscriber::fmt().with_env_filter(filter);
        if self.log_json {
            fmt.json().init();
        } else {
            fmt.init();
        }
        Ok(())
    }
}

#[derive(clap::Args)]
struct RunArgs {
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = params::WEFT_OPERATOR_HTTP_ADDR.name(), default_value = params::WEFT_OPERATOR_HTTP_ADDR.fixed_default())]
    http_addr: SocketAddr,
    /// Sidecar image for jobs that do not name one.
    #[arg(
        long,
        env = params::WEFT_SIDECAR_IMAGE.name(),
        default_value = params::WEFT_SIDECAR_IMAGE.fixed_default()
    )]
    sidecar_image: String,
    /// OTLP endpoint for jobs that do not name one.
    #[arg(long, env = params::WEFT_OTLP_ENDPOINT.name())]
    otlp_endpoint: Option<String>,
    /// Elect a leader through a Lease (required with more than one replica).
    #[arg(long, env = params::WEFT_LEADER_ELECT.name(), default_value = params::WEFT_LEADER_ELECT.fixed_default(), action = clap::ArgAction::Set)]
    leader_elect: bool,
    /// Namespace of the leader Lease (the operator's own namespace).
    #[arg(long, env = params::POD_NAMESPACE.name(), default_value = params::POD_NAMESPACE.fixed_default())]
    lease_namespace: String,
    /// Identity in the Lease (the pod name).
    #[arg(long, env = params::POD_NAME.name())]
    identity: Option<String>,
    /// Watch the job Secrets (needs list/watch on Secrets; see the chart's rbac.watchSecrets).
    #[arg(long, env = params::WEFT_WATCH_SECRETS.name(), default_value = params::WEFT_WATCH_SECRETS.fixed_default(), action = clap::ArgAction::Set)]
    watch_secrets: bool,
    #[command(flatten)]
    log: LogArgs,
    /// After SIGTERM, exit at the latest this many seconds later, whatever is
    /// still running (keep it below the pod's terminationGracePeriodSeconds).
    #[arg(long, default_value_t = 20)]
    shutdown_timeout_secs: u64,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Crd) => {
            print!("{}", weft_operator::crd::crd_yaml());
            Ok(())
        }
        Some(Command::Run(args)) => runtime()?.block_on(run(args)),
        Some(Command::Render {
            file,
            namespace,
            sidecar_image,
        }) => render(&file, &namespace, sidecar_image),
        Some(Command::Uninstall {
            namespace,
            deployment,
            stop_timeout_secs,
            log,
        }) => {
            log.init()?;
            let cfg = UninstallConfig {
                namespace,
                deployment,
                lease: leader::LEASE_NAME.into(),
                stop_timeout: Duration::from_secs(stop_timeout_secs),
                poll_every: Duration::from_secs(1),
            };
            runtime()?.block_on(async {
                uninstall::uninstall(Client::try_default().await?, &cfg).await?;
                Ok(())
            })
        }
        None => runtime()?.block_on(run(cli.run)),
    }
}

fn render(file: &str, namespace: &str, sidecar_image: String) -> anyhow::Result<()> {
    use serde::Deserialize;
    use weft_operator::resources::{desired_pod, desired_secret, desired_service, validate};
    let text = if file == "-" {
        std::io::read_to_string(std::io::stdin())?
    } else {
        std::fs::read_to_string(file)?
    };
    let cfg = OperatorConfig {
        sidecar_image,
        otlp_endpoint: None,
    };
    let mut docs = vec![];
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let value = serde_yaml::Value::deserialize(doc)?;
        if value.get("kind").and_then(|k| k.as_str()) != Some("CollectiveJob") {
            continue;
        }
        let mut job: CollectiveJob = serde_yaml::from_value(value)?;
        if job.metadata.namespace.is_none() {
            job.metadata.namespace = Some(namespace.into());
        }
        // Owner references need a uid; the API server assigns the real one.
        job.metadata.uid.get_or_insert_with(|| "<uid>".into());
        if let Err(e) = validate(&job) {
            anyhow::bail!("invalid CollectiveJob: {e}");
        }
        docs.push(serde_yaml::to_string(&desired_service(&job))?);
        docs.push(serde_yaml::to_string(&desired_secret(
            &job,
            "<random token>",
        ))?);
        for i in 0..job.spec.replicas {
            docs.push(serde_yaml::to_string(&desired_pod(&job, i, 0, &cfg))?);
        }
    }
    print!("{}", docs.join("---\n"));
    Ok(())
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}

/// Resolves on SIGTERM (kubelet) or Ctrl-C.
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = term => info!("SIGTERM received, shutting down"),
        _ = tokio::signal::ctrl_c() => info!("interrupt received, shutting down"),
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    args.log.init()?;

    let metrics = Arc::new(Metrics::default());
    let readiness = Arc::new(Readiness::default());

    // One shutdown signal, observed by every phase below. Installed first, so
    // that SIGTERM is handled whatever the operator is waiting for, and
    // backed by a hard deadline: the process exits within the grace period
    // even if a graceful step hangs (a frozen API server connection).
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let grace = Duration::from_secs(args.shutdown_timeout_secs);
    let stopping = readiness.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        stopping.stopping.store(true, Ordering::Relaxed);
        let _ = stop_tx.send(true);
        tokio::time::sleep(grace).await;
        error!(?grace, "graceful shutdown did not finish in time; exiting");
        std::process::exit(1);
    });
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };

    let http_state = HttpState {
        metrics: metrics.clone(),
        readiness: readiness.clone(),
    };
    let addr = args.http_addr;
    tokio::spawn(async move {
        if let Err(e) = http::serve(addr, http_state).await {
            error!(error = %e, "HTTP server failed");
            std::process::exit(1);
        }
    });

    let client = Client::try_default().await?;
    // Untyped: one CollectiveJob that does not decode must not stop the operator.
    let raw_jobs: Api<DynamicObject> =
        Api::all_with(client.clone(), &ApiResource::erase::<CollectiveJob>(&()));
    let probe = ListParams::default().limit(1);
    tokio::select! {
        r = raw_jobs.list(&probe) => if let Err(e) = r {
            anyhow::bail!(
                "cannot list CollectiveJobs ({e}); is the CRD installed? (weft-operator crd | kubectl apply -f -)"
            );
        },
        _ = stopped() => return Ok(()),
    }

    let lease = if args.leader_elect {
        let identity = args
            .identity
            .clone()
            .unwrap_or_else(|| format!("weft-operator-{}", std::process::id()));
        let cfg = LeaseConfig::new(&args.lease_namespace, &identity);
        if let Err(e) = cfg.check() {
            anyhow::bail!("leader election: {e}");
        }
        let api: Api<Lease> = Api::namespaced(client.clone(), &cfg.namespace);
        info!(identity = %cfg.identity, "waiting for leadership");
        let standby = readiness.clone();
        tokio::select! {
            r = leader::acquire(&api, &cfg, |ok| standby.standby_ok.store(ok, Ordering::Relaxed)) => {
                if let Err(e) = r {
                    anyhow::bail!("leader election: the API server refuses the Lease ({e}); exiting");
                }
            }
            _ = stopped() => return Ok(()),
        }
        let (api2, cfg2, m2, r2) = (api.clone(), cfg.clone(), metrics.clone(), readiness.clone());
        let leading = tokio::spawn(async move {
            let why = leader::lead(&api2, &cfg2, &m2, &r2).await;
            // Never keep reconciling without the lease: exit and let the
            // kubelet restart us as a standby.
            error!(reason = ?why, "lost leadership; exiting");
            std::process::exit(1);
        });
        Some((api, cfg, leading))
    } else {
        readiness.leading.store(true, Ordering::Relaxed);
        None
    };

    let config = OperatorConfig {
        sidecar_image: args.sidecar_image,
        otlp_endpoint: args.otlp_endpoint,
    };
    let mut ctx = Context::new(client.clone(), config, metrics.clone());
    ctx.readiness = readiness.clone();
    let ctx = Arc::new(ctx);
    info!("controller starting");
    controller::run(client, ctx, args.watch_secrets, stopped()).await;
    info!("controller stopped");
    if let Some((api, cfg, leading)) = lease {
        // Stop renewing first: a renewal after the release would take the
        // free Lease back.
        leading.abort();
        let _ = leading.await;
        metrics.leader.set(0);
        readiness.leading.store(false, Ordering::Relaxed);
        leader::release(&api, &cfg).await;
    }
    Ok(())
}
