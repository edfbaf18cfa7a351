//! A gRPC channel to a sidecar over its Unix socket.

use std::path::PathBuf;
use tonic::transport::{Channel, Endpoint, Uri};

pub async fn connect(path: PathBuf) -> Result<Channel, tonic::transport::Error> {
    // The URI is a placeholder: the connector below ignores it.
    Endpoint::from_static("http://weft.sidecar")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }))
        .await
}

pub async fn sidecar(
    path: PathBuf,
) -> Result<crate::rpc::sidecar_client::SidecarClient<Channel>, tonic::transport::Error> {
    Ok(
        crate::rpc::sidecar_client::SidecarClient::new(connect(path).await?)
            .max_decoding_message_size(64 << 20),
    )
}
