//! Serving the REST API (plain HTTP on loopback, or HTTPS) with
//! axum-server: HTTP/1.1 only, a deadline for a request's headers and a
//! cap on open connections, so that slow or idle clients cannot take the
//! file descriptors replication needs.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

/// How long a client may take to send a request's headers, from the
/// first byte (and after a TLS handshake, which has its own deadline).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Default `[api] max_connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

/// An acceptor that refuses a connection (closes it at once) while
/// `permits` are all taken, and holds one permit per open connection.
#[derive(Clone)]
pub struct Limited<A> {
    inner: A,
    permits: Arc<Semaphore>,
}

impl<A> Limited<A> {
    /// At most `max` connections at a time through `inner`.
    pub fn new(inner: A, max: usize) -> Self {
        Limited {
            inner,
            permits: Arc::new(Semaphore::new(max)),
        }
    }
}

type Accepting<T> = Pin<Box<dyn Future<Output = io::Result<T>> + Send>>;

impl<A, I, S> axum_server::accept::Accept<I, S> for Limited<A>
where
    A: axum_server::accept::Accept<I, S>,
    A::Future: Send + 'static,
{
    type Stream = Counted<A::Stream>;
    type Service = A::Service;
    type Future = Accepting<(Self::Stream, Self::Service)>;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        // Taken before the TLS handshake, so handshakes count too.
        let permit = self.permits.clone().try_acquire_owned();
        let accepting = self.inner.accept(stream, service);
        Box::pin(async move {
            let Ok(permit) = permit else {
                tracing::warn!("refusing an API connection: [api] max_connections are open");
                drop(accepting); // closes the connection
                return Err(io::Error::other("too many API connections"));
            };
            let (stream, service) = accepting.await?;
            Ok((
                Counted {
                    inner: stream,
                    _permit: permit,
                },
                service,
            ))
        })
    }
}

/// A connection holding its permit until it closes.
pub struct Counted<S> {
    inner: S,
    _permit: OwnedSemaphorePermit,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Serves `router` on `listener` (HTTPS with `tls`) until `stop`, then
/// lets requests in flight finish for up to 500 ms.
///
/// # Errors
/// The listener cannot be handed to the server.
pub fn spawn(
    listener: std::net::TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    max_connections: usize,
    router: axum::Router,
    stop: CancellationToken,
) -> io::Result<tokio::task::JoinHandle<()>> {
    let handle = axum_server::Handle::new();
    let h = handle.clone();
    tokio::spawn(async move {
        stop.cancelled().await;
        h.graceful_shutdown(Some(Duration::from_millis(500)));
    });
    let service = router.into_make_service();
    Ok(match tls {
        None => {
            let mut server = axum_server::from_tcp(listener)?
                .handle(handle)
                .map(|a| Limited::new(a, max_connections));
            tune(server.http_builder());
            tokio::spawn(async move {
                if let Err(e) = server.serve(service).await {
                    tracing::error!(error = %e, "API server failed");
                }
            })
        }
        Some(tls) => {
            let mut server = axum_server::from_tcp_rustls(
                listener,
                axum_server::tls_rustls::RustlsConfig::from_config(tls),
            )?
            .handle(handle)
            .map(|a| Limited::new(a, max_connections));
            tune(server.http_builder());
            tokio::spawn(async move {
                if let Err(e) = server.serve(service).await {
                    tracing::error!(error = %e, "API server failed");
                }
            })
        }
    })
}

/// HTTP/1.1 only (every client Ferry has speaks it, and an early error
/// answer to a request with a body then reaches every client), with the
/// header deadline.
fn tune(b: &mut hyper_util::server::conn::auto::Builder<hyper_util::rt::TokioExecutor>) {
    *b = b.clone().http1_only();
    b.http1().header_read_timeout(HEADER_TIMEOUT);
}
