//! Plugins in OCI registries: pulled by digest, verified, cached by digest; pushed.
//!
//! A plugin is stored the way `wkg oci push` and `oras` store a Wasm component (the CNCF
//! Wasm OCI artifact layout): an image manifest whose config has the media type
//! `application/vnd.wasm.config.v0+json` and whose one layer, `application/wasm`, is the
//! component.
//!
//! A pull never trusts a tag twice: the tag is **resolved to a manifest digest once**
//! (a `HEAD` of the manifest), the signature is checked for that digest (with
//! `--verify-key`), and everything after is fetched **by that digest** and checked
//! against it (the manifest's bytes, then the layer's, each hashed): a tag moved between
//! the check and the fetch cannot slip another artifact in (the check-then-use race of
//! Crossplane's GHSA-wfqx-gjrf-g28r). The cache is content-addressed like an OCI image
//! layout (`manifests/sha256/HEX`, `blobs/sha256/HEX`) and re-hashed when read, so a
//! digest already pulled costs one `HEAD` and no download, and a corrupted cache file is
//! fetched again.
//!
//! The client is `oci-client` (the ORAS project's, used by wasmtime's `wkg` and by
//! Kubewarden), on the process's rustls with ring.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::manifest::{
    IMAGE_MANIFEST_MEDIA_TYPE, OCI_IMAGE_MEDIA_TYPE, OciDescriptor, OciImageManifest, OciManifest,
};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use sha2::{Digest as _, Sha256};
use tracing::{debug, info};

use crate::signature::{
    SIGNATURE_ANNOTATION, SIMPLE_SIGNING_MEDIA_TYPE, SigningKey, VerifyKey, simple_signing_payload,
};

/// The scheme that names a plugin in a registry: `oci://REGISTRY/REPOSITORY[:TAG][@DIGEST]`.
pub const SCHEME: &str = "oci://";
/// The config media type of a Wasm OCI artifact.
pub const WASM_CONFIG_MEDIA_TYPE: &str = "application/vnd.wasm.config.v0+json";
/// The layer media type of a Wasm OCI artifact.
pub const WASM_LAYER_MEDIA_TYPE: &str = "application/wasm";
/// The largest component pulled (Python plugins, which carry their interpreter, are
/// about 40 MiB).
pub const MAX_COMPONENT_BYTES: i64 = 256 * 1024 * 1024;
/// The largest manifest or signature payload read.
const MAX_SMALL_BYTES: usize = 4 * 1024 * 1024;

/// Why a plugin could not be pulled, pushed or trusted.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// The reference does not parse.
    #[error(
        "{reference:?} is not an OCI reference (oci://REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST]): {reason}"
    )]
    BadReference {
        /// What was given.
        reference: String,
        /// Why it does not parse.
        reason: String,
    },
    /// The registry answered with an error, or could not be reached.
    #[error("{reference}: {source}")]
    Registry {
        /// What was asked.
        reference: String,
        /// The client's error.
        #[source]
        source: oci_client::errors::OciDistributionError,
    },
    /// The artifact is not a Wasm component in the layout this host reads.
    #[error("{reference}: not a Wasm component artifact: {reason}")]
    NotWasm {
        /// What was pulled.
        reference: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Content did not hash to the digest it was fetched by.
    #[error("{reference}: {what} does not match its digest {digest}")]
    DigestMismatch {
        /// What was pulled.
        reference: String,
        /// The manifest or the layer.
        what: &'static str,
        /// The digest it should have.
        digest: String,
    },
    /// `--verify-key` is set and no valid signature was found.
    #[error("{reference}: refused: {reason}")]
    Unsigned {
        /// The artifact, by digest.
        reference: String,
        /// What was (not) found.
        reason: String,
    },
    /// No registry client could be made on this machine.
    #[error("{0} (the system has no CA roots: mount a bundle and set SSL_CERT_FILE)")]
    NoClient(String),
    /// The cache directory could not be written.
    #[error("cannot write the OCI cache {}: {source}", path.display())]
    Cache {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// Parses `oci://REGISTRY/REPOSITORY[:TAG][@DIGEST]` (the scheme is optional). A
/// reference without a registry is refused: a plugin is never pulled from Docker Hub by
/// accident of a short name.
pub fn parse_reference(text: &str) -> Result<Reference, OciError> {
    let bare = text.trim().strip_prefix(SCHEME).unwrap_or(text.trim());
    let bad = |reason: String| OciError::BadReference {
        reference: text.trim().to_string(),
        reason,
    };
    let first = bare.split('/').next().unwrap_or_default();
    if !bare.contains('/') || !(first.contains('.') || first.contains(':') || first == "localhost")
    {
        return Err(bad(
            "name the registry (host or host:port) before the repository".into(),
        ));
    }
    let reference: Reference = bare.parse().map_err(|e| bad(format!("{e}")))?;
    if let Some(digest) = reference.digest()
        && !is_sha256_digest(digest)
    {
        return Err(bad(format!("{digest} is not a sha256 digest")));
    }
    Ok(reference)
}

/// `sha256:` and 64 lowercase hex digits.
fn is_sha256_digest(digest: &str) -> bool {
    digest.strip_prefix("sha256:").is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    })
}

/// `sha256:HEX` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

/// Registry credentials, each for its own registry: what `imagePullSecrets` hold (a
/// Docker `config.json`, `{"auths": {"REGISTRY": {"auth": base64("USER:PASSWORD")}}}`,
/// or `username` and `password` in place of `auth`).
#[derive(Clone, Default)]
pub struct Credentials(BTreeMap<String, (String, String)>);

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The registries, never the secrets.
        f.debug_set().entries(self.0.keys()).finish()
    }
}

/// Why a credentials file was not read.
#[derive(Debug, thiserror::Error)]
#[error("{}: {reason}", path.display())]
pub struct CredentialsError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub reason: String,
}

impl Credentials {
    /// The registry a `config.json` key or a reference names, as one key: no scheme or
    /// path, lower case, Docker Hub's names as `docker.io`.
    fn registry_key(registry: &str) -> String {
        let host = registry
            .trim()
            .trim_start_matches("https://")
            .trim_start_matches("http://");
        let host = host
            .split('/')
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        match host.as_str() {
            "index.docker.io" | "registry-1.docker.io" => "docker.io".to_string(),
            _ => host,
        }
    }

    /// Reads a Docker `config.json` (the `.dockerconfigjson` of an image pull Secret).
    pub fn from_file(path: &Path) -> Result<Self, CredentialsError> {
        let bad = |reason: String| CredentialsError {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        Self::from_config_json(&text).map_err(bad)
    }

    /// Parses a Docker `config.json`.
    pub fn from_config_json(text: &str) -> Result<Self, String> {
        use base64::Engine as _;
        let config: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let auths = config
            .get("auths")
            .and_then(serde_json::Value::as_object)
            .ok_or("no \"auths\" object (the config.json of docker login, or the .dockerconfigjson of an image pull Secret)")?;
        let mut credentials = BTreeMap::new();
        for (registry, entry) in auths {
            let field = |name: &str| entry.get(name).and_then(serde_json::Value::as_str);
            let pair = match (field("username"), field("password"), field("auth")) {
                (Some(user), Some(password), _) => (user.to_string(), password.to_string()),
                (_, _, Some(auth)) => {
                    let decoded = base64::engine::general_purpose::STANDARD
                        .decode(auth.trim())
                        .map_err(|e| format!("{registry}: auth is not base64: {e}"))?;
                    let decoded = String::from_utf8(decoded)
                        .map_err(|_| format!("{registry}: auth is not text"))?;
                    let (user, password) = decoded
                        .split_once(':')
                        .ok_or(format!("{registry}: auth is not USER:PASSWORD"))?;
                    (user.to_string(), password.to_string())
                }
                _ => {
                    return Err(format!(
                        "{registry}: neither auth nor username and password"
                    ));
                }
            };
            credentials.insert(Self::registry_key(registry), pair);
        }
        Ok(Credentials(credentials))
    }

    /// The credentials of `registry`, if it has its own.
    pub fn of(&self, registry: &str) -> Option<&(String, String)> {
        self.0.get(&Self::registry_key(registry))
    }
}

/// How the store reaches registries.
#[derive(Debug, Clone, Default)]
pub struct OciOptions {
    /// Where pulled manifests and components are kept, by digest.
    pub cache: PathBuf,
    /// Registries (`host:port`) spoken to over plain HTTP (a registry on loopback in a
    /// test); every other one over HTTPS.
    pub plain_http: Vec<String>,
    /// Basic credentials by registry (`host[:port]`, Docker Hub as `docker.io`); a
    /// registry not named is spoken to anonymously. Credentials are sent only to their
    /// own registry ([`Credentials`]).
    pub credentials: Credentials,
    /// With a key, an artifact is used only once a cosign signature of its digest by
    /// that key verifies.
    pub verify_key: Option<VerifyKey>,
}

/// A component pulled from a registry.
#[derive(Debug, Clone)]
pub struct Pulled {
    /// The manifest digest the reference resolved to.
    pub digest: String,
    /// The component's bytes.
    pub bytes: Vec<u8>,
}

/// Pulls and pushes plugins; one per process (it keeps the registries' tokens).
pub struct OciStore {
    /// The client; why there is none (no CA roots on the machine, say): every pull and
    /// push then fails with that line, and nothing else does.
    client: Result<Client, String>,
    opts: OciOptions,
    /// What could not be written to the cache directory (read-only, full): kept in
    /// memory instead, the last [`MEMORY_ENTRIES`], so that resolving a tag again does
    /// not download its component again.
    memory: std::sync::Mutex<std::collections::VecDeque<(String, Vec<u8>)>>,
}

/// How many manifests and components the store keeps in memory when its cache directory
/// cannot be written.
const MEMORY_ENTRIES: usize = 8;

impl std::fmt::Debug for OciStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OciStore")
            .field("opts", &self.opts)
            .finish()
    }
}

impl OciStore {
    /// A store with `opts`.
    pub fn new(opts: OciOptions) -> Self {
        // The client's TLS is the rustls that kube and the webhook build, with ring: its
        // provider is the process's default (an error only says one is installed).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let config = ClientConfig {
            protocol: if opts.plain_http.is_empty() {
                ClientProtocol::Https
            } else {
                ClientProtocol::HttpsExcept(opts.plain_http.clone())
            },
            connect_timeout: Some(std::time::Duration::from_secs(10)),
            read_timeout: Some(std::time::Duration::from_secs(60)),
            ..Default::default()
        };
        // oci-client falls back to a default client when its own cannot be built, and
        // that one panics; so the TLS setup (the system's CA roots) is tried first.
        let client = match reqwest::Client::builder().build() {
            Ok(_) => Ok(Client::new(config)),
            Err(e) => Err(format!(
                "cannot make the registry client: {}",
                std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| s.to_string())
            )),
        };
        OciStore {
            client,
            opts,
            memory: Default::default(),
        }
    }

    fn client(&self) -> Result<&Client, OciError> {
        self.client
            .as_ref()
            .map_err(|e| OciError::NoClient(e.clone()))
    }

    /// The credentials of `reference`'s registry, and none other's.
    fn auth(&self, reference: &Reference) -> RegistryAuth {
        match self.opts.credentials.of(reference.registry()) {
            Some((user, password)) => RegistryAuth::Basic(user.clone(), password.clone()),
            None => RegistryAuth::Anonymous,
        }
    }

    fn registry_error(
        reference: &Reference,
    ) -> impl FnOnce(oci_client::errors::OciDistributionError) -> OciError + '_ {
        move |source| OciError::Registry {
            reference: reference.whole(),
            source,
        }
    }

    /// The manifest digest `reference` names now: its own digest if it has one, else
    /// what the registry says its tag is.
    pub async fn resolve(&self, reference: &Reference) -> Result<String, OciError> {
        if let Some(digest) = reference.digest() {
            return Ok(digest.to_string());
        }
        let digest = self
            .client()?
            .fetch_manifest_digest(reference, &self.auth(reference))
            .await
            .map_err(Self::registry_error(reference))?;
        if !is_sha256_digest(&digest) {
            return Err(OciError::NotWasm {
                reference: reference.whole(),
                reason: format!("the registry names it {digest}, not a sha256 digest"),
            });
        }
        Ok(digest)
    }

    /// Resolves `reference` to a digest, verifies the signature of that digest (with a
    /// key), then fetches the component by that digest (or takes it from the cache).
    pub async fn pull(&self, reference: &Reference) -> Result<Pulled, OciError> {
        let digest = self.resolve(reference).await?;
        let by_digest = Reference::with_digest(
            reference.registry().to_string(),
            reference.repository().to_string(),
            digest.clone(),
        );
        if let Some(key) = &self.opts.verify_key {
            self.verify_signature(&by_digest, &digest, key).await?;
        }
        let manifest_bytes = match self.cached("manifests", &digest).await {
            Some(bytes) => bytes,
            None => {
                let (bytes, _) = self
                    .client()?
                    .pull_manifest_raw(
                        &by_digest,
                        &self.auth(&by_digest),
                        &[OCI_IMAGE_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE],
                    )
                    .await
                    .map_err(Self::registry_error(&by_digest))?;
                self.check_digest(&bytes, &digest, &by_digest, "the manifest")?;
                self.store("manifests", &digest, &bytes).await;
                bytes.to_vec()
            }
        };
        let layer = wasm_layer(&manifest_bytes).map_err(|reason| OciError::NotWasm {
            reference: by_digest.whole(),
            reason,
        })?;
        let bytes = match self.cached("blobs", &layer.digest).await {
            Some(bytes) => bytes,
            None => {
                let mut bytes = Vec::with_capacity(usize::try_from(layer.size).unwrap_or(0));
                self.client()?
                    .pull_blob(&by_digest, &layer, &mut bytes)
                    .await
                    .map_err(Self::registry_error(&by_digest))?;
                self.check_digest(&bytes, &layer.digest, &by_digest, "the component layer")?;
                self.store("blobs", &layer.digest, &bytes).await;
                info!(reference = %reference.whole(), %digest, bytes = bytes.len(), "plugin pulled");
                bytes
            }
        };
        Ok(Pulled { digest, bytes })
    }

    /// A cosign signature of `digest` by `key` is in the repository of `by_digest`.
    async fn verify_signature(
        &self,
        by_digest: &Reference,
        digest: &str,
        key: &VerifyKey,
    ) -> Result<(), OciError> {
        let unsigned = |reason: String| OciError::Unsigned {
            reference: by_digest.whole(),
            reason,
        };
        let sig_tag = Reference::with_tag(
            by_digest.registry().to_string(),
            by_digest.repository().to_string(),
            signature_tag(digest),
        );
        // The signature image by digest too: what is verified is what was read.
        let sig_digest = match self
            .client()?
            .fetch_manifest_digest(&sig_tag, &self.auth(&sig_tag))
            .await
        {
            Ok(d) => d,
            Err(e) if not_found(&e) => {
                return Err(unsigned(format!(
                    "no signature ({} not found) and --verify-key {} is set",
                    sig_tag.whole(),
                    key.path().display()
                )));
            }
            Err(source) => return Err(Self::registry_error(&sig_tag)(source)),
        };
        let sig_ref = sig_tag.clone_with_digest(sig_digest.clone());
        let (bytes, _) = self
            .client()?
            .pull_manifest_raw(
                &sig_ref,
                &self.auth(&sig_ref),
                &[OCI_IMAGE_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE],
            )
            .await
            .map_err(Self::registry_error(&sig_ref))?;
        self.check_digest(&bytes, &sig_digest, &sig_ref, "the signature manifest")?;
        let manifest: OciImageManifest = serde_json::from_slice(&bytes)
            .map_err(|e| unsigned(format!("the signature manifest is not JSON: {e}")))?;
        let mut last = String::from("the signature image has no cosign signature layer");
        for layer in &manifest.layers {
            let Some(signature) = layer
                .annotations
                .as_ref()
                .and_then(|a| a.get(SIGNATURE_ANNOTATION))
            else {
                continue;
            };
            if layer.size < 0 || layer.size as usize > MAX_SMALL_BYTES {
                last = format!("a signature payload of {} bytes", layer.size);
                continue;
            }
            let mut payload = Vec::new();
            self.client()?
                .pull_blob(&sig_ref, layer, &mut payload)
                .await
                .map_err(Self::registry_error(&sig_ref))?;
            self.check_digest(&payload, &layer.digest, &sig_ref, "a signature payload")?;
            let repository = format!("{}/{}", by_digest.registry(), by_digest.repository());
            match key.verify_simple_signing(&payload, signature, digest, &repository) {
                Ok(()) => {
                    debug!(reference = %by_digest.whole(), key = %key.path().display(), "signature verified");
                    return Ok(());
                }
                Err(e) => last = e.to_string(),
            }
        }
        Err(unsigned(format!(
            "no signature by {} verifies ({last})",
            key.path().display()
        )))
    }

    fn check_digest(
        &self,
        bytes: &[u8],
        digest: &str,
        reference: &Reference,
        what: &'static str,
    ) -> Result<(), OciError> {
        if sha256_digest(bytes) == digest {
            Ok(())
        } else {
            Err(OciError::DigestMismatch {
                reference: reference.whole(),
                what,
                digest: digest.to_string(),
            })
        }
    }

    fn cache_path(&self, kind: &str, digest: &str) -> Option<PathBuf> {
        let hex = digest.strip_prefix("sha256:")?;
        Some(self.opts.cache.join(kind).join("sha256").join(hex))
    }

    /// The cached content of `digest`, if it is there and still hashes to it.
    async fn cached(&self, kind: &str, digest: &str) -> Option<Vec<u8>> {
        let on_disk = match self.cache_path(kind, digest) {
            Some(path) => tokio::fs::read(path).await.ok(),
            None => None,
        }
        .filter(|bytes| sha256_digest(bytes) == digest);
        on_disk.or_else(|| {
            let memory = self.memory.lock().expect("OCI memory cache lock");
            memory
                .iter()
                .find(|(d, _)| d == digest)
                .map(|(_, bytes)| bytes.clone())
        })
    }

    /// Keeps `bytes` as `digest`: in the cache directory, else (it cannot be written) in
    /// memory. A cache is worth downloads, never a plugin: its failure is a warning.
    async fn store(&self, kind: &str, digest: &str, bytes: &[u8]) {
        if let Err(e) = self.write(kind, digest, bytes).await {
            tracing::warn!("{e}: kept in memory instead");
            let mut memory = self.memory.lock().expect("OCI memory cache lock");
            memory.retain(|(d, _)| d != digest);
            if memory.len() == MEMORY_ENTRIES {
                memory.pop_front();
            }
            memory.push_back((digest.to_string(), bytes.to_vec()));
        }
    }

    /// Writes `bytes` as `digest` (aside, then renamed: a reader never sees half).
    async fn write(&self, kind: &str, digest: &str, bytes: &[u8]) -> Result<(), OciError> {
        let Some(path) = self.cache_path(kind, digest) else {
            return Ok(());
        };
        let err = |source| OciError::Cache {
            path: path.clone(),
            source,
        };
        let dir = path.parent().expect("a cache file has a directory");
        tokio::fs::create_dir_all(dir).await.map_err(err)?;
        let tmp = dir.join(format!(".{}.{}", std::process::id(), fastrand::u64(..)));
        tokio::fs::write(&tmp, bytes).await.map_err(err)?;
        if let Err(e) = tokio::fs::rename(&tmp, &path).await {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(err(e));
        }
        Ok(())
    }

    /// Pushes `component` to `reference` (which names a tag) as a Wasm OCI artifact and,
    /// with `sign`, a cosign signature of its digest beside it. Returns the digest.
    pub async fn push(
        &self,
        reference: &Reference,
        component: &[u8],
        sign: Option<&SigningKey>,
    ) -> Result<String, OciError> {
        let layer_digest = sha256_digest(component);
        let config = serde_json::to_vec(&serde_json::json!({
            "created": "1970-01-01T00:00:00Z",
            "architecture": "wasm",
            "os": "wasip2",
            "layerDigests": [layer_digest],
        }))
        .expect("JSON serializes");
        let manifest = OciImageManifest {
            schema_version: 2,
            media_type: Some(OCI_IMAGE_MEDIA_TYPE.to_string()),
            config: descriptor(WASM_CONFIG_MEDIA_TYPE, &config),
            layers: vec![descriptor(WASM_LAYER_MEDIA_TYPE, component)],
            ..Default::default()
        };
        let digest = self
            .push_image(reference, &[&config, component], &manifest)
            .await?;
        if let Some(key) = sign {
            let docker_reference = format!("{}/{}", reference.registry(), reference.repository());
            let payload = simple_signing_payload(&docker_reference, &digest);
            let mut layer = descriptor(SIMPLE_SIGNING_MEDIA_TYPE, &payload);
            layer.annotations = Some(BTreeMap::from([(
                SIGNATURE_ANNOTATION.to_string(),
                key.sign(&payload),
            )]));
            let config = serde_json::to_vec(&serde_json::json!({
                "architecture": "",
                "os": "",
                "config": {},
                "rootfs": {"type": "layers", "diff_ids": [layer.digest]},
            }))
            .expect("JSON serializes");
            let sig_manifest = OciImageManifest {
                schema_version: 2,
                media_type: Some(OCI_IMAGE_MEDIA_TYPE.to_string()),
                config: descriptor("application/vnd.oci.image.config.v1+json", &config),
                layers: vec![layer],
                ..Default::default()
            };
            let sig_ref = Reference::with_tag(
                reference.registry().to_string(),
                reference.repository().to_string(),
                signature_tag(&digest),
            );
            self.push_image(&sig_ref, &[&config, &payload], &sig_manifest)
                .await?;
        }
        Ok(digest)
    }

    /// Pushes the blobs, then the manifest; the manifest's digest.
    async fn push_image(
        &self,
        reference: &Reference,
        blobs: &[&[u8]],
        manifest: &OciImageManifest,
    ) -> Result<String, OciError> {
        self.client()?
            .store_auth_if_needed(reference.resolve_registry(), &self.auth(reference))
            .await;
        // The token for pushing (anonymous registries answer without one).
        if let Err(e) = self
            .client()?
            .auth(
                reference,
                &self.auth(reference),
                oci_client::RegistryOperation::Push,
            )
            .await
        {
            debug!("no push token: {e}");
        }
        for blob in blobs {
            let digest = sha256_digest(blob);
            let exists = self
                .client()?
                .blob_exists(reference, &digest)
                .await
                .unwrap_or(false);
            if !exists {
                match self
                    .client()?
                    .push_blob(reference, blob.to_vec(), &digest)
                    .await
                {
                    Ok(_) => {}
                    // The blob was stored (201), but the registry named no Location, as
                    // go-containerregistry's does: the spec's MUST, yet what a client
                    // needs is only that the blob is there.
                    Err(oci_client::errors::OciDistributionError::RegistryNoLocationError)
                        if self
                            .client()?
                            .blob_exists(reference, &digest)
                            .await
                            .unwrap_or(false) => {}
                    Err(source) => return Err(Self::registry_error(reference)(source)),
                }
            }
        }
        let body = serde_json::to_vec(manifest).expect("a manifest serializes");
        let digest = sha256_digest(&body);
        self.client()?
            .push_manifest_raw(
                reference,
                body,
                OCI_IMAGE_MEDIA_TYPE.parse().expect("a valid header value"),
            )
            .await
            .map_err(Self::registry_error(reference))?;
        Ok(digest)
    }
}

/// Whether the registry said that what was asked for does not exist.
fn not_found(e: &oci_client::errors::OciDistributionError) -> bool {
    use oci_client::errors::{OciDistributionError as E, OciErrorCode as C};
    match e {
        E::ImageManifestNotFoundError(_) => true,
        E::RegistryError { envelope, .. } => envelope
            .errors
            .iter()
            .any(|e| matches!(e.code, C::ManifestUnknown | C::NameUnknown | C::NotFound)),
        E::RequestError(e) => e.status() == Some(reqwest::StatusCode::NOT_FOUND),
        _ => false,
    }
}

/// The tag of cosign's signature of `digest`: `sha256-HEX.sig`.
pub fn signature_tag(digest: &str) -> String {
    format!("{}.sig", digest.replace(':', "-"))
}

fn descriptor(media_type: &str, bytes: &[u8]) -> OciDescriptor {
    OciDescriptor {
        media_type: media_type.to_string(),
        digest: sha256_digest(bytes),
        size: bytes.len() as i64,
        urls: None,
        annotations: None,
    }
}

/// The component layer of a Wasm artifact's manifest.
fn wasm_layer(manifest: &[u8]) -> Result<OciDescriptor, String> {
    let manifest: OciManifest = serde_json::from_slice(manifest)
        .map_err(|e| format!("its manifest does not parse: {e}"))?;
    let OciManifest::Image(manifest) = manifest else {
        return Err("it is an image index, not one artifact".into());
    };
    let layers: Vec<&OciDescriptor> = manifest
        .layers
        .iter()
        .filter(|l| l.media_type == WASM_LAYER_MEDIA_TYPE)
        .collect();
    let [layer] = layers.as_slice() else {
        let types: Vec<&str> = manifest
            .layers
            .iter()
            .map(|l| l.media_type.as_str())
            .collect();
        return Err(format!(
            "it needs exactly one {WASM_LAYER_MEDIA_TYPE} layer, it has {types:?} (config {})",
            manifest.config.media_type
        ));
    };
    if !is_sha256_digest(&layer.digest) {
        return Err(format!("its layer digest {} is not sha256", layer.digest));
    }
    if layer.size < 0 || layer.size > MAX_COMPONENT_BYTES {
        return Err(format!(
            "its layer is {} bytes, more than the {MAX_COMPONENT_BYTES} a plugin may have",
            layer.size
        ));
    }
    Ok((*layer).clone())
}

/// The default cache: `$CAPSTAN_CACHE_DIR/oci`, else `$XDG_CACHE_HOME/capstan/oci`, else
/// `~/.cache/capstan/oci`, else a directory under the system's temporary one.
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CAPSTAN_CACHE_DIR") {
        return Path::new(&dir).join("oci");
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Path::new(&dir).join("capstan/oci");
    }
    match std::env::var_os("HOME") {
        Some(home) => Path::new(&home).join(".cache/capstan/oci"),
        None => std::env::temp_dir().join("capstan-oci"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_go_to_their_own_registry_only() {
        use base64::Engine as _;
        let auth = base64::engine::general_purpose::STANDARD.encode("robot:s3cret");
        let config = format!(
            r#"{{"auths": {{"registry.example.com": {{"auth": "{auth}"}},
                "https://index.docker.io/v1/": {{"username": "hub", "password": "pw"}}}}}}"#
        );
        let credentials = Credentials::from_config_json(&config).unwrap();
        let store = OciStore::new(OciOptions {
            credentials,
            ..OciOptions::default()
        });
        let auth_of = |reference: &str| match store.auth(&parse_reference(reference).unwrap()) {
            RegistryAuth::Basic(user, password) => Some((user, password)),
            RegistryAuth::Anonymous => None,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            auth_of("oci://registry.example.com/plugins/x:1"),
            Some(("robot".into(), "s3cret".into()))
        );
        assert_eq!(
            auth_of("oci://docker.io/library/x:1"),
            Some(("hub".into(), "pw".into()))
        );
        // Another registry, a look-alike, another port: anonymous.
        for elsewhere in [
            "oci://evil.example.com/plugins/x:1",
            "oci://registry.example.com.evil.io/plugins/x:1",
            "oci://registry.example.com:5000/plugins/x:1",
        ] {
            assert_eq!(auth_of(elsewhere), None, "{elsewhere}");
        }
        assert!(
            !format!("{:?}", store.opts.credentials).contains("s3cret"),
            "a debug print shows no secret"
        );
        for (bad, says) in [
            ("{}", "no \"auths\" object"),
            (
                r#"{"auths": {"r": {"auth": "!!"}}}"#,
                "r: auth is not base64",
            ),
            (
                r#"{"auths": {"r": {}}}"#,
                "r: neither auth nor username and password",
            ),
        ] {
            let err = Credentials::from_config_json(bad).unwrap_err();
            assert!(err.contains(says), "{err}");
        }
    }

    #[test]
    fn references_name_their_registry_and_digests_are_sha256() {
        let r = parse_reference("oci://127.0.0.1:5000/plugins/uuid:1.0").unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("127.0.0.1:5000", "plugins/uuid", Some("1.0"))
        );
        let digest = format!("sha256:{}", "a".repeat(64));
        let r = parse_reference(&format!("ghcr.io/acme/uuid@{digest}")).unwrap();
        assert_eq!(r.digest(), Some(digest.as_str()));
        for bad in [
            "oci://uuid:1.0",
            "oci://plugins/uuid:1.0",
            "oci://127.0.0.1:5000/Plugins/UUID",
            "oci://ghcr.io/acme/uuid@sha512:abcd",
        ] {
            let err = parse_reference(bad).unwrap_err();
            assert!(
                err.to_string().contains("is not an OCI reference"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn only_a_single_wasm_layer_manifest_is_a_plugin() {
        let wasm = b"\0asm";
        let good = OciImageManifest {
            config: descriptor(WASM_CONFIG_MEDIA_TYPE, b"{}"),
            layers: vec![descriptor(WASM_LAYER_MEDIA_TYPE, wasm)],
            ..Default::default()
        };
        let layer = wasm_layer(&serde_json::to_vec(&good).unwrap()).unwrap();
        assert_eq!(layer.digest, sha256_digest(wasm));

        let mut image = good.clone();
        image.layers = vec![descriptor(
            "application/vnd.oci.image.layer.v1.tar+gzip",
            b"x",
        )];
        let err = wasm_layer(&serde_json::to_vec(&image).unwrap()).unwrap_err();
        assert!(err.contains("exactly one application/wasm layer"), "{err}");

        let mut huge = good.clone();
        huge.layers[0].size = MAX_COMPONENT_BYTES + 1;
        let err = wasm_layer(&serde_json::to_vec(&huge).unwrap()).unwrap_err();
        assert!(err.contains("more than the"), "{err}");
        let err = wasm_layer(b"not json").unwrap_err();
        assert!(err.starts_with("its manifest does not parse"), "{err}");
    }

    #[tokio::test]
    async fn the_cache_rehashes_what_it_reads() {
        let dir = tempfile::tempdir().unwrap();
        let store = OciStore::new(OciOptions {
            cache: dir.path().to_path_buf(),
            ..Default::default()
        });
        let digest = sha256_digest(b"component");
        store.store("blobs", &digest, b"component").await;
        assert_eq!(store.cached("blobs", &digest).await.unwrap(), b"component");
        // A file changed on disk is a miss (fetched again), never served.
        std::fs::write(store.cache_path("blobs", &digest).unwrap(), b"tampered").unwrap();
        assert!(store.cached("blobs", &digest).await.is_none());
    }

    #[tokio::test]
    async fn a_cache_that_cannot_be_written_keeps_the_last_entries_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        // A file where the cache directory should be: nothing can be written under it.
        let file = dir.path().join("not-a-directory");
        std::fs::write(&file, b"").unwrap();
        let store = OciStore::new(OciOptions {
            cache: file,
            ..Default::default()
        });
        let contents: Vec<Vec<u8>> = (0..=MEMORY_ENTRIES).map(|i| vec![i as u8; 16]).collect();
        for bytes in &contents {
            store.store("blobs", &sha256_digest(bytes), bytes).await;
        }
        // The oldest went; the last ones are served from memory.
        assert!(
            store
                .cached("blobs", &sha256_digest(&contents[0]))
                .await
                .is_none()
        );
        for bytes in &contents[1..] {
            assert_eq!(
                store.cached("blobs", &sha256_digest(bytes)).await.as_ref(),
                Some(bytes)
            );
        }
    }

    #[test]
    fn the_signature_tag_is_cosigns() {
        let digest = format!("sha256:{}", "0f".repeat(32));
        assert_eq!(
            signature_tag(&digest),
            format!("sha256-{}.sig", "0f".repeat(32))
        );
    }
}
