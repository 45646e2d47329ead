//! The webhook's certificates: a CA the host makes itself, and a serving certificate it
//! signs for the names the API server reaches the webhook at. Both are renewed once a
//! third of their life is left; a CA being replaced stays in the bundle the API server
//! trusts until it expires, so that a certificate it signed stays valid meanwhile.

use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// Why certificates could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// rcgen refused the parameters or could not sign.
    #[error("cannot make a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// Stored material is not PEM of the expected kind.
    #[error("the stored {what} is not valid PEM")]
    Pem {
        /// Which part.
        what: &'static str,
    },
    /// rustls does not take the key.
    #[error("rustls refuses the serving key: {0}")]
    Key(#[from] rustls::Error),
}

/// How long the host's certificates are valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifetimes {
    /// The CA's validity.
    pub ca: Duration,
    /// The serving certificate's validity (never beyond the CA's).
    pub serving: Duration,
}

impl Default for Lifetimes {
    /// A CA for a year, serving certificates for 30 days: renewed after about 243 and
    /// 20 days (a third of their life left).
    fn default() -> Self {
        Lifetimes {
            ca: Duration::from_secs(365 * 24 * 3600),
            serving: Duration::from_secs(30 * 24 * 3600),
        }
    }
}

/// How far back a certificate's `notBefore` is set: clocks of the API server and of the
/// host may differ a little.
const CLOCK_SKEW: Duration = Duration::from_secs(3600);

/// Common name of the host's CA; a CA is rebuilt as an issuer from its key and this
/// name, which must therefore never change.
const CA_NAME: &str = "capstan webhook CA";

/// A certificate (PEM) and when it expires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pem {
    /// The certificate, PEM.
    pub cert: String,
    /// Its `notAfter`.
    pub not_after: SystemTime,
}

/// The certificates and keys of one webhook: what the server presents and what the API
/// server is told to trust.
#[derive(Clone, PartialEq, Eq)]
pub struct Material {
    /// The CA that signs serving certificates.
    pub ca: Pem,
    /// The CA's key, PEM (PKCS#8).
    pub ca_key: String,
    /// The CA before the last renewal, trusted until it expires.
    pub previous_ca: Option<Pem>,
    /// The serving certificate.
    pub serving: Pem,
    /// Its key, PEM (PKCS#8).
    pub serving_key: String,
    /// The names (DNS names or IP addresses) the serving certificate is valid for.
    pub names: Vec<String>,
}

impl std::fmt::Debug for Material {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys.
        f.debug_struct("Material")
            .field("ca_not_after", &self.ca.not_after)
            .field("serving_not_after", &self.serving.not_after)
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}

/// Whether less than a third of `lifetime` is left before `not_after`.
fn due(not_after: SystemTime, lifetime: Duration, now: SystemTime) -> bool {
    match not_after.duration_since(now) {
        Ok(left) => left < lifetime / 3,
        Err(_) => true,
    }
}

impl Material {
    /// A new CA and a serving certificate for `names`, valid from `now`.
    pub fn generate(
        names: &[String],
        lifetimes: Lifetimes,
        now: SystemTime,
    ) -> Result<Self, TlsError> {
        let ca_key = KeyPair::generate()?;
        let ca_not_after = now + lifetimes.ca;
        let mut params = ca_params();
        params.not_before = (now - CLOCK_SKEW).into();
        params.not_after = ca_not_after.into();
        let ca = params.self_signed(&ca_key)?;
        let ca_key = ca_key.serialize_pem();
        let (serving, serving_key) = serving_cert(&ca_key, ca_not_after, names, lifetimes, now)?;
        Ok(Material {
            ca: Pem {
                cert: ca.pem(),
                not_after: truncate(ca_not_after),
            },
            ca_key,
            previous_ca: None,
            serving,
            serving_key,
            names: names.to_vec(),
        })
    }

    /// The material renewed as it is due at `now` for `names`: a new CA (the current one
    /// kept as the previous) when a third of its life is left, else a new serving
    /// certificate when a third of its life is left or its names changed. `None` when
    /// nothing is due. A previous CA that expired is dropped.
    pub fn renewed(
        &self,
        names: &[String],
        lifetimes: Lifetimes,
        now: SystemTime,
    ) -> Result<Option<Self>, TlsError> {
        if due(self.ca.not_after, lifetimes.ca, now) {
            let mut next = Material::generate(names, lifetimes, now)?;
            next.previous_ca = (self.ca.not_after > now).then(|| self.ca.clone());
            return Ok(Some(next));
        }
        let expired_previous = self
            .previous_ca
            .as_ref()
            .is_some_and(|p| p.not_after <= now);
        if due(self.serving.not_after, lifetimes.serving, now) || self.names != names {
            let (serving, serving_key) =
                serving_cert(&self.ca_key, self.ca.not_after, names, lifetimes, now)?;
            let mut next = self.clone();
            next.serving = serving;
            next.serving_key = serving_key;
            next.names = names.to_vec();
            if expired_previous {
                next.previous_ca = None;
            }
            return Ok(Some(next));
        }
        if expired_previous {
            let mut next = self.clone();
            next.previous_ca = None;
            return Ok(Some(next));
        }
        Ok(None)
    }

    /// The CAs the API server must trust (`caBundle`), PEM: the current one, and the
    /// previous one while it is valid.
    pub fn ca_bundle(&self) -> String {
        let mut bundle = self.ca.cert.clone();
        if let Some(previous) = &self.previous_ca {
            bundle.push_str(&previous.cert);
        }
        bundle
    }

    /// The serving certificate and key as rustls serves them.
    pub fn certified_key(&self) -> Result<Arc<CertifiedKey>, TlsError> {
        let certs = CertificateDer::pem_slice_iter(self.serving.cert.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| TlsError::Pem {
                what: "serving certificate",
            })?;
        if certs.is_empty() {
            return Err(TlsError::Pem {
                what: "serving certificate",
            });
        }
        let key = PrivateKeyDer::from_pem_slice(self.serving_key.as_bytes()).map_err(|_| {
            TlsError::Pem {
                what: "serving key",
            }
        })?;
        let key = rustls::crypto::ring::sign::any_supported_type(&key)?;
        Ok(Arc::new(CertifiedKey::new(certs, key)))
    }

    /// The material as the data of a Secret (values as text).
    pub fn to_secret_data(&self) -> Vec<(&'static str, String)> {
        let mut data = vec![
            ("ca.crt", self.ca.cert.clone()),
            ("ca.key", self.ca_key.clone()),
            ("ca.not-after", unix(self.ca.not_after)),
            ("tls.crt", self.serving.cert.clone()),
            ("tls.key", self.serving_key.clone()),
            ("tls.not-after", unix(self.serving.not_after)),
            ("names", self.names.join(",")),
        ];
        if let Some(previous) = &self.previous_ca {
            data.push(("previous-ca.crt", previous.cert.clone()));
            data.push(("previous-ca.not-after", unix(previous.not_after)));
        }
        data
    }

    /// The material a Secret's data holds (see [`Material::to_secret_data`]); `None` when
    /// a part is missing or malformed (the Secret is then written anew).
    pub fn from_secret_data(get: impl Fn(&str) -> Option<String>) -> Option<Self> {
        let time = |key: &str| -> Option<SystemTime> {
            let secs: u64 = get(key)?.trim().parse().ok()?;
            Some(UNIX_EPOCH + Duration::from_secs(secs))
        };
        let previous_ca = match (get("previous-ca.crt"), time("previous-ca.not-after")) {
            (Some(cert), Some(not_after)) => Some(Pem { cert, not_after }),
            _ => None,
        };
        let material = Material {
            ca: Pem {
                cert: get("ca.crt")?,
                not_after: time("ca.not-after")?,
            },
            ca_key: get("ca.key")?,
            previous_ca,
            serving: Pem {
                cert: get("tls.crt")?,
                not_after: time("tls.not-after")?,
            },
            serving_key: get("tls.key")?,
            names: get("names")?
                .split(',')
                .filter(|n| !n.is_empty())
                .map(String::from)
                .collect(),
        };
        // Usable only if rustls takes it and the CA key loads.
        material.certified_key().ok()?;
        KeyPair::from_pem(&material.ca_key).ok()?;
        Some(material)
    }
}

/// The parameters of the host's CA (also those it is rebuilt from as an issuer).
fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, CA_NAME);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params
}

/// A serving certificate for `names`, signed by the CA whose key is `ca_key`, valid
/// from `now` for the serving lifetime but never beyond the CA.
fn serving_cert(
    ca_key: &str,
    ca_not_after: SystemTime,
    names: &[String],
    lifetimes: Lifetimes,
    now: SystemTime,
) -> Result<(Pem, String), TlsError> {
    let issuer = Issuer::new(ca_params(), KeyPair::from_pem(ca_key)?);
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(names.to_vec())?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(
        DnType::CommonName,
        names.first().map_or("capstan webhook", String::as_str),
    );
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    let not_after = (now + lifetimes.serving).min(ca_not_after);
    params.not_before = (now - CLOCK_SKEW).into();
    params.not_after = not_after.into();
    let cert = params.signed_by(&key, &issuer)?;
    Ok((
        Pem {
            cert: cert.pem(),
            not_after: truncate(not_after),
        },
        key.serialize_pem(),
    ))
}

/// A time to whole seconds, as certificates and the Secret keep it.
fn truncate(t: SystemTime) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()))
}

fn unix(t: SystemTime) -> String {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        .to_string()
}

/// The certificate the server presents, swapped in place when it is renewed: a
/// connection takes the one current at its handshake.
#[derive(Debug)]
pub struct ServingCert(RwLock<Arc<CertifiedKey>>);

impl ServingCert {
    /// Serving `key`.
    pub fn new(key: Arc<CertifiedKey>) -> Self {
        ServingCert(RwLock::new(key))
    }

    /// Serves `key` from the next handshake on.
    pub fn set(&self, key: Arc<CertifiedKey>) {
        *self.0.write().expect("serving certificate lock") = key;
    }
}

impl ResolvesServerCert for ServingCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().expect("serving certificate lock").clone())
    }
}

/// The rustls configuration of the webhook server: TLS 1.2 and 1.3 with ring, no
/// client certificates (the API server authenticates the webhook, not the reverse),
/// HTTP/1.1.
pub fn server_config(cert: Arc<ServingCert>) -> Result<rustls::ServerConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(cert);
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(24 * 3600);

    fn names() -> Vec<String> {
        vec![
            "capstan-webhook.capstan-system.svc".into(),
            "127.0.0.1".into(),
        ]
    }

    #[test]
    fn a_fresh_material_serves_and_is_not_due() {
        let now = SystemTime::now();
        let m = Material::generate(&names(), Lifetimes::default(), now).unwrap();
        assert!(m.ca_bundle().starts_with("-----BEGIN CERTIFICATE-----"));
        assert_eq!(m.ca_bundle().matches("BEGIN CERTIFICATE").count(), 1);
        m.certified_key().unwrap();
        assert!(m.serving.not_after <= m.ca.not_after);
        assert!(
            m.renewed(&names(), Lifetimes::default(), now + DAY)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn the_serving_certificate_is_renewed_with_a_third_of_its_life_left() {
        let now = SystemTime::now();
        let lifetimes = Lifetimes::default();
        let m = Material::generate(&names(), lifetimes, now).unwrap();
        assert!(
            m.renewed(&names(), lifetimes, now + 19 * DAY)
                .unwrap()
                .is_none()
        );
        let later = now + 21 * DAY;
        let renewed = m.renewed(&names(), lifetimes, later).unwrap().expect("due");
        assert_eq!(renewed.ca, m.ca, "the same CA signs it");
        assert_ne!(renewed.serving, m.serving);
        assert!(renewed.serving.not_after > m.serving.not_after);
        renewed.certified_key().unwrap();
        // New names: a new certificate at once.
        let mut other = names();
        other.push("localhost".into());
        let renamed = m.renewed(&other, lifetimes, now).unwrap().expect("due");
        assert_eq!(renamed.names, other);
    }

    #[test]
    fn a_renewed_ca_keeps_the_previous_one_trusted_until_it_expires() {
        let now = SystemTime::now();
        let lifetimes = Lifetimes::default();
        let m = Material::generate(&names(), lifetimes, now).unwrap();
        let later = now + 250 * DAY;
        let renewed = m.renewed(&names(), lifetimes, later).unwrap().expect("due");
        assert_ne!(renewed.ca, m.ca);
        assert_eq!(renewed.previous_ca.as_ref(), Some(&m.ca));
        assert_eq!(renewed.ca_bundle().matches("BEGIN CERTIFICATE").count(), 2);
        // Once the previous CA expired, it leaves the bundle.
        let after = m.ca.not_after + DAY;
        let pruned = renewed
            .renewed(&names(), lifetimes, after)
            .unwrap()
            .expect("due");
        assert_eq!(pruned.previous_ca, None);
        assert_eq!(pruned.ca, renewed.ca);
    }

    #[test]
    fn the_material_round_trips_through_a_secret() {
        let now = SystemTime::now();
        let lifetimes = Lifetimes::default();
        let m = Material::generate(&names(), lifetimes, now).unwrap();
        let m = m
            .renewed(&names(), lifetimes, now + 250 * DAY)
            .unwrap()
            .unwrap();
        let data: std::collections::BTreeMap<_, _> = m.to_secret_data().into_iter().collect();
        let back = Material::from_secret_data(|k| data.get(k).cloned()).expect("complete");
        assert_eq!(back, m);
        // A part missing or broken: not usable.
        assert!(
            Material::from_secret_data(|k| (k != "tls.key")
                .then(|| data.get(k).cloned())
                .flatten())
            .is_none()
        );
        assert!(
            Material::from_secret_data(|k| if k == "tls.key" {
                Some("garbage".into())
            } else {
                data.get(k).cloned()
            })
            .is_none()
        );
    }
}
