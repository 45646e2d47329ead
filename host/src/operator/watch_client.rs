//! The client the watches use: the host's client, with every LIST and WATCH counted in
//! bytes (`capstan_watch_bytes`), and, for a sharded parent watch, a `shardSelector`
//! added to the query (kube-rs has no such parameter; the API server reads it on LIST
//! and WATCH alike).

use bytes::Bytes;
use http::{Request, Uri};
use http_body_util::BodyExt;
use kube::Client;
use kube::client::Body;
use prometheus_client::metrics::counter::Counter;

/// A client that sends what `client` sends, adds `shardSelector=<shard_selector>` to
/// every GET (the watches only GET: LIST and WATCH) and counts the response bytes in
/// `bytes`. It shares `client`'s connections.
pub fn watch_client(client: &Client, shard_selector: Option<String>, bytes: Counter) -> Client {
    let inner = client.clone();
    let service = tower::service_fn(move |mut request: Request<Body>| {
        let inner = inner.clone();
        let bytes = bytes.clone();
        if let Some(selector) = &shard_selector
            && request.method() == http::Method::GET
        {
            *request.uri_mut() = with_query_param(request.uri(), "shardSelector", selector);
        }
        async move {
            let response = inner.send(request).await?;
            Ok::<_, kube::Error>(response.map(|body| {
                body.map_frame(move |frame: http_body::Frame<Bytes>| {
                    if let Some(data) = frame.data_ref() {
                        bytes.inc_by(data.len() as u64);
                    }
                    frame
                })
            }))
        }
    });
    Client::new(service, client.default_namespace().to_string())
}

/// `uri` with `name=value` (percent-encoded) added to its query.
fn with_query_param(uri: &Uri, name: &str, value: &str) -> Uri {
    let encoded = percent_encode(value);
    let path_and_query = match uri.query() {
        Some(q) if !q.is_empty() => format!("{}?{q}&{name}={encoded}", uri.path()),
        _ => format!("{}?{name}={encoded}", uri.path()),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(
        path_and_query
            .parse()
            .expect("a path and a percent-encoded query make a valid URI"),
    );
    Uri::from_parts(parts).expect("only the query changed")
}

/// Everything but RFC 3986's unreserved characters, percent-encoded.
fn percent_encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selector_is_added_to_the_query_percent_encoded() {
        let uri: Uri = "https://h:6443/apis/demo.operator/v1/uuids?watch=true&resourceVersion=5"
            .parse()
            .unwrap();
        let out = with_query_param(&uri, "shardSelector", "shardRange(a, '0x1', '0x2') || x");
        assert_eq!(
            out.to_string(),
            "https://h:6443/apis/demo.operator/v1/uuids?watch=true&resourceVersion=5\
             &shardSelector=shardRange%28a%2C%20%270x1%27%2C%20%270x2%27%29%20%7C%7C%20x"
        );
        let bare: Uri = "/api/v1/configmaps".parse().unwrap();
        assert_eq!(
            with_query_param(&bare, "k", "v").to_string(),
            "/api/v1/configmaps?k=v"
        );
    }
}
