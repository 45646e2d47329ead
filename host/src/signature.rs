//! Plugin signatures, as cosign makes them with a key (no transparency log, no
//! certificate: verified offline with the public key alone).
//!
//! Two places hold a signature:
//! - **a file of the plugin directory**, `NAME.wasm`: beside it `NAME.wasm.sig`, what
//!   `cosign sign-blob --key cosign.key --tlog-upload=false --output-signature
//!   NAME.wasm.sig NAME.wasm` writes (or `capstan sign`): the base64 of an ECDSA P-256
//!   signature (ASN.1 DER) over the SHA-256 of the file;
//! - **an artifact of an OCI registry**: cosign's "simple signing" image beside it, at
//!   the tag `sha256-HEX.sig` of the same repository, whose layers are each a JSON
//!   payload naming the signed manifest digest (`critical.image.docker-manifest-digest`)
//!   with the base64 signature of that payload in the layer's annotation
//!   `dev.cosignproject.cosign/signature` (what `cosign sign --key … --tlog-upload=false`
//!   or `capstan push --sign-key` writes).
//!
//! Keys are ECDSA P-256 (cosign's `generate-key-pair`), read as PEM: the public key as
//! `PUBLIC KEY` (`cosign.pub`); a private key, for `capstan sign` and `push`, as an
//! unencrypted PKCS#8 `PRIVATE KEY` or SEC1 `EC PRIVATE KEY` (cosign's own encrypted key
//! is for cosign). The crypto is RustCrypto's `p256` (`ecdsa` with SHA-256).

use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use p256::ecdsa::signature::{Signer as _, Verifier as _};
use p256::ecdsa::{Signature, SigningKey as P256SigningKey, VerifyingKey};
use p256::pkcs8::{DecodePrivateKey as _, DecodePublicKey as _, EncodePublicKey as _, LineEnding};

/// The annotation of a cosign signature layer that holds the signature.
pub const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
/// The media type of a cosign signature layer (its payload).
pub const SIMPLE_SIGNING_MEDIA_TYPE: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
/// The `critical.type` of a cosign payload.
const PAYLOAD_TYPE: &str = "cosign container image signature";
/// What a signature file of the plugin directory is named after its plugin file.
pub const SIG_SUFFIX: &str = ".sig";

/// Why a key or a signature was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum SignatureError {
    /// The key file could not be read.
    #[error("cannot read the key {}: {source}", path.display())]
    ReadKey {
        /// The key file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The key file is not a key this host reads.
    #[error("{}: {reason}", path.display())]
    BadKey {
        /// The key file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The signature is not base64 of a DER ECDSA signature.
    #[error("the signature is malformed: {0}")]
    Malformed(String),
    /// The signature does not verify with the key.
    #[error("the signature does not match the key")]
    Mismatch,
    /// The signed payload is not a cosign payload for this digest.
    #[error("the signed payload {0}")]
    Payload(String),
}

/// A public key that signatures are verified with (`--verify-key`).
#[derive(Clone, Debug)]
pub struct VerifyKey {
    key: VerifyingKey,
    /// Where it was read from, for messages.
    path: PathBuf,
}

impl VerifyKey {
    /// Reads a PEM `PUBLIC KEY` (ECDSA P-256), as `cosign generate-key-pair` writes it.
    pub fn from_pem_file(path: &Path) -> Result<Self, SignatureError> {
        let pem = std::fs::read_to_string(path).map_err(|source| SignatureError::ReadKey {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_pem(&pem, path)
    }

    /// Reads `pem`, which came from `path`.
    pub fn from_pem(pem: &str, path: &Path) -> Result<Self, SignatureError> {
        let bad = |reason: String| SignatureError::BadKey {
            path: path.to_path_buf(),
            reason,
        };
        if !pem.contains("-----BEGIN PUBLIC KEY-----") {
            return Err(bad(
                "not a PEM public key (-----BEGIN PUBLIC KEY-----, as cosign.pub)".into(),
            ));
        }
        let key = VerifyingKey::from_public_key_pem(pem.trim()).map_err(|e| {
            bad(format!(
                "not an ECDSA P-256 public key (cosign's default, the only kind read): {e}"
            ))
        })?;
        Ok(VerifyKey {
            key,
            path: path.to_path_buf(),
        })
    }

    /// Where the key was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Checks `signature` (base64 of an ASN.1 DER ECDSA signature, whitespace around it
    /// ignored) over `message`.
    pub fn verify(&self, message: &[u8], signature: &str) -> Result<(), SignatureError> {
        let der = STANDARD
            .decode(signature.trim())
            .map_err(|e| SignatureError::Malformed(format!("not base64: {e}")))?;
        let signature = Signature::from_der(&der)
            .map_err(|e| SignatureError::Malformed(format!("not a DER ECDSA signature: {e}")))?;
        self.key
            .verify(message, &signature)
            .map_err(|_| SignatureError::Mismatch)
    }

    /// Checks a cosign signature layer: `signature` over `payload`, and `payload` names
    /// `manifest_digest` of the repository `docker_reference` (registry and repository,
    /// as pulled): a signature made for one repository does not pass for another that
    /// holds the same bytes.
    pub fn verify_simple_signing(
        &self,
        payload: &[u8],
        signature: &str,
        manifest_digest: &str,
        docker_reference: &str,
    ) -> Result<(), SignatureError> {
        self.verify(payload, signature)?;
        check_payload(payload, manifest_digest, docker_reference)
    }
}

/// A private key that `capstan sign` and `capstan push --sign-key` sign with.
pub struct SigningKey {
    key: P256SigningKey,
}

impl SigningKey {
    /// Reads an unencrypted PEM private key: PKCS#8 (`PRIVATE KEY`) or SEC1
    /// (`EC PRIVATE KEY`), ECDSA P-256.
    pub fn from_pem_file(path: &Path) -> Result<Self, SignatureError> {
        let pem = std::fs::read_to_string(path).map_err(|source| SignatureError::ReadKey {
            path: path.to_path_buf(),
            source,
        })?;
        let bad = |reason: &str| SignatureError::BadKey {
            path: path.to_path_buf(),
            reason: reason.to_string(),
        };
        let pem = pem.trim();
        if pem.contains("ENCRYPTED") {
            return Err(bad(
                "an encrypted private key (as cosign.key) is not read here: sign with cosign \
                 (`cosign sign-blob` / `cosign sign`), or give an unencrypted PKCS#8 key",
            ));
        }
        let key = if pem.contains("-----BEGIN EC PRIVATE KEY-----") {
            p256::SecretKey::from_sec1_pem(pem)
                .map(P256SigningKey::from)
                .map_err(|_| bad("not an ECDSA P-256 private key (SEC1 PEM)"))?
        } else if pem.contains("-----BEGIN PRIVATE KEY-----") {
            P256SigningKey::from_pkcs8_pem(pem)
                .map_err(|_| bad("not an ECDSA P-256 private key (PKCS#8 PEM)"))?
        } else {
            return Err(bad(
                "not a PEM private key (-----BEGIN PRIVATE KEY----- or -----BEGIN EC PRIVATE KEY-----)",
            ));
        };
        Ok(SigningKey { key })
    }

    /// A key from its 32-byte scalar (tests).
    #[cfg(test)]
    pub fn from_scalar(bytes: [u8; 32]) -> Self {
        SigningKey {
            key: P256SigningKey::from_bytes(&bytes.into()).expect("a valid scalar"),
        }
    }

    /// The base64 of the DER ECDSA P-256/SHA-256 signature of `message`, as cosign
    /// writes it.
    pub fn sign(&self, message: &[u8]) -> String {
        let signature: Signature = self.key.sign(message);
        STANDARD.encode(signature.to_der().as_bytes())
    }

    /// The public key, as PEM (`PUBLIC KEY`, as cosign.pub).
    pub fn public_pem(&self) -> String {
        self.key
            .verifying_key()
            .to_public_key_pem(LineEnding::LF)
            .expect("a P-256 public key encodes")
    }
}

/// Cosign's payload for `manifest_digest` of the image `docker_reference` (registry and
/// repository, no tag).
pub fn simple_signing_payload(docker_reference: &str, manifest_digest: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "critical": {
            "identity": {"docker-reference": docker_reference},
            "image": {"docker-manifest-digest": manifest_digest},
            "type": PAYLOAD_TYPE,
        },
        "optional": null,
    }))
    .expect("JSON of strings serializes")
}

/// `reference` with Docker Hub's two names made one (cosign writes
/// `index.docker.io/...`, a reference may say `docker.io/...`).
fn canonical_repository(reference: &str) -> String {
    match reference.strip_prefix("docker.io/") {
        Some(rest) => format!("index.docker.io/{rest}"),
        None => reference.to_string(),
    }
}

/// `payload` is a cosign payload that names `manifest_digest` of `docker_reference`.
fn check_payload(
    payload: &[u8],
    manifest_digest: &str,
    docker_reference: &str,
) -> Result<(), SignatureError> {
    let value: serde_json::Value = serde_json::from_slice(payload)
        .map_err(|e| SignatureError::Payload(format!("is not JSON: {e}")))?;
    let kind = value.pointer("/critical/type").and_then(|v| v.as_str());
    if kind != Some(PAYLOAD_TYPE) {
        return Err(SignatureError::Payload(format!(
            "is not a cosign image signature (critical.type {kind:?})"
        )));
    }
    let signed = value
        .pointer("/critical/image/docker-manifest-digest")
        .and_then(|v| v.as_str());
    if signed != Some(manifest_digest) {
        return Err(SignatureError::Payload(format!(
            "signs {}, not {manifest_digest}",
            signed.unwrap_or("no digest")
        )));
    }
    let identity = value
        .pointer("/critical/identity/docker-reference")
        .and_then(|v| v.as_str());
    if identity.map(canonical_repository) != Some(canonical_repository(docker_reference)) {
        return Err(SignatureError::Payload(format!(
            "signs the image of {}, not of {docker_reference}",
            identity.unwrap_or("no repository")
        )));
    }
    Ok(())
}

/// The signature file of the plugin file `wasm`: `NAME.wasm.sig`.
pub fn sig_file_of(wasm: &Path) -> PathBuf {
    let mut name = wasm.as_os_str().to_os_string();
    name.push(SIG_SUFFIX);
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Made by cosign v2.6.5 (`host/tests/fixtures/cosign/README.md` says how).
    const COSIGN_PUB: &str = include_str!("../tests/fixtures/cosign/cosign.pub");
    const BLOB: &[u8] = include_bytes!("../tests/fixtures/cosign/blob.txt");
    const BLOB_SIG: &str = include_str!("../tests/fixtures/cosign/blob.txt.sig");
    const PAYLOAD: &[u8] = include_bytes!("../tests/fixtures/cosign/payload.json");
    const PAYLOAD_SIG: &str = include_str!("../tests/fixtures/cosign/payload.sig");
    const PAYLOAD_DIGEST: &str = include_str!("../tests/fixtures/cosign/payload.digest");

    fn cosign_key() -> VerifyKey {
        VerifyKey::from_pem(COSIGN_PUB, Path::new("cosign.pub")).unwrap()
    }

    #[test]
    fn a_blob_signed_by_cosign_verifies_and_a_changed_byte_does_not() {
        let key = cosign_key();
        key.verify(BLOB, BLOB_SIG).unwrap();
        let mut changed = BLOB.to_vec();
        changed[0] ^= 1;
        assert!(matches!(
            key.verify(&changed, BLOB_SIG),
            Err(SignatureError::Mismatch)
        ));
    }

    #[test]
    fn an_image_signature_by_cosign_verifies_for_its_digest_only() {
        let key = cosign_key();
        let digest = PAYLOAD_DIGEST.trim();
        let repository = "127.0.0.1:5077/plugins/fixture";
        key.verify_simple_signing(PAYLOAD, PAYLOAD_SIG, digest, repository)
            .unwrap();
        let other = format!("sha256:{}", "0".repeat(64));
        let err = key
            .verify_simple_signing(PAYLOAD, PAYLOAD_SIG, &other, repository)
            .unwrap_err();
        assert!(
            err.to_string().contains(&format!("signs {digest}")),
            "{err}"
        );
    }

    #[test]
    fn a_signature_made_for_another_repository_does_not_pass() {
        // The same bytes pushed to another repository, its signature copied along.
        let key = cosign_key();
        let digest = PAYLOAD_DIGEST.trim();
        for elsewhere in [
            "127.0.0.1:5077/plugins/other",
            "127.0.0.1:5078/plugins/fixture",
            "127.0.0.1:5077/plugins/fixture/more",
        ] {
            let err = key
                .verify_simple_signing(PAYLOAD, PAYLOAD_SIG, digest, elsewhere)
                .unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "{}",
                    SignatureError::Payload(format!(
                        "signs the image of 127.0.0.1:5077/plugins/fixture, not of {elsewhere}"
                    ))
                )
            );
        }
        assert_eq!(
            canonical_repository("docker.io/library/x"),
            canonical_repository("index.docker.io/library/x")
        );
    }

    #[test]
    fn a_signature_by_another_key_is_a_mismatch() {
        let other = SigningKey::from_scalar([7; 32]);
        let signature = other.sign(BLOB);
        assert!(matches!(
            cosign_key().verify(BLOB, &signature),
            Err(SignatureError::Mismatch)
        ));
        // The same signature verifies with its own key.
        let own = VerifyKey::from_pem(&other.public_pem(), Path::new("own.pub")).unwrap();
        own.verify(BLOB, &signature).unwrap();
    }

    #[test]
    fn our_payload_and_signature_verify_as_cosign_reads_them() {
        let key = SigningKey::from_scalar([9; 32]);
        let digest = format!("sha256:{}", "ab".repeat(32));
        let payload = simple_signing_payload("127.0.0.1:5000/plugins/uuid", &digest);
        let signature = key.sign(&payload);
        let public = VerifyKey::from_pem(&key.public_pem(), Path::new("k.pub")).unwrap();
        public
            .verify_simple_signing(&payload, &signature, &digest, "127.0.0.1:5000/plugins/uuid")
            .unwrap();
        // cosign's own payload has the same shape: the fields verification reads.
        let theirs: serde_json::Value = serde_json::from_slice(PAYLOAD).unwrap();
        let ours: serde_json::Value = serde_json::from_slice(&payload).unwrap();
        for path in ["/critical/type", "/critical/identity/docker-reference"] {
            assert!(theirs.pointer(path).is_some() && ours.pointer(path).is_some());
        }
        assert_eq!(
            theirs.pointer("/critical/type"),
            ours.pointer("/critical/type")
        );
    }

    #[test]
    fn garbage_is_malformed_not_a_panic() {
        let key = cosign_key();
        for bad in ["", "not base64!", "AAAA"] {
            assert!(
                matches!(key.verify(BLOB, bad), Err(SignatureError::Malformed(_))),
                "{bad:?}"
            );
        }
        let err = VerifyKey::from_pem("hello", Path::new("x.pub")).unwrap_err();
        assert!(
            err.to_string().starts_with("x.pub: not a PEM public key"),
            "{err}"
        );
    }

    #[test]
    fn the_signature_file_is_named_after_the_plugin_file() {
        assert_eq!(
            sig_file_of(Path::new("/p/uuid.wasm")),
            PathBuf::from("/p/uuid.wasm.sig")
        );
    }
}
