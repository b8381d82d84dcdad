//! TLS 1.3 for the QUIC transport: who a node is ([`TlsIdentity`]), whom it
//! trusts ([`PeerTrust`]), and why a peer was refused ([`TlsError`]).
//!
//! Two ways to trust a peer:
//! - **Cluster CA** ([`PeerTrust::Ca`]): every node has a certificate signed
//!   by the cluster's CA; the sender checks the decode worker's chain and
//!   name, and a decode worker configured with the CA as client trust
//!   requires and checks the sender's certificate too (mutual TLS).
//! - **Pinned** ([`PeerTrust::Pinned`]), for development: the decode worker
//!   runs with a self-signed certificate ([`TlsIdentity::self_signed`]) and
//!   the sender accepts exactly the certificate whose SHA-256 fingerprint it
//!   was given. The handshake signature is still verified against that
//!   certificate's key, so presenting the certificate without the key fails.
//!
//! Crypto is ring's (no aws-lc-rs build). Certificate refusals are recorded
//! by the verifiers so the caller gets a typed reason, not a TLS alert code.

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};

use crate::ErrorKind;

/// ALPN protocol id: a peer that is not a tandem KV peer fails the handshake.
pub const ALPN: &[u8] = b"tandem-kv/1";

/// SHA-256 of a certificate's DER encoding, as `sha256sum` or
/// `openssl x509 -fingerprint -sha256` prints it (hex; colons optional when parsing).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CertFingerprint(pub [u8; 32]);

impl CertFingerprint {
    /// The fingerprint of a DER-encoded certificate.
    pub fn of(der: &[u8]) -> Self {
        Self(Sha256::digest(der).into())
    }
}

impl fmt::Display for CertFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for CertFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CertFingerprint({self})")
    }
}

impl FromStr for CertFingerprint {
    type Err = TlsError;

    /// 64 hex digits, optionally separated by colons.
    fn from_str(s: &str) -> Result<Self, TlsError> {
        let hex: Vec<u8> = s.bytes().filter(|&b| b != b':').collect();
        let bad = || TlsError::Config { what: "certificate fingerprint", why: format!("{s:?} is not 64 hex digits") };
        if hex.len() != 64 {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (o, pair) in out.iter_mut().zip(hex.chunks(2)) {
            let pair = std::str::from_utf8(pair).map_err(|_| bad())?;
            *o = u8::from_str_radix(pair, 16).map_err(|_| bad())?;
        }
        Ok(Self(out))
    }
}

/// Why a TLS setting is unusable or a peer was refused. Refusals say which
/// side refused and why, so an operator can tell a wrong CA from a stale pin.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsError {
    /// A certificate, key or CA file cannot be read or used (local configuration).
    #[error("{what}: {why}")]
    Config { what: &'static str, why: String },
    /// The peer's certificate does not chain to the cluster CA, has expired,
    /// or is not valid for the expected name.
    #[error("peer certificate not trusted: {0}")]
    Untrusted(String),
    /// The peer's certificate is not the pinned one.
    #[error("peer certificate {got} is not the pinned {expected}")]
    FingerprintMismatch { expected: CertFingerprint, got: CertFingerprint },
    /// The peer ended the handshake: it refused our certificate (or our lack
    /// of one), or it speaks another application protocol.
    #[error("peer refused the TLS handshake: {0}")]
    RefusedByPeer(String),
}

impl TlsError {
    /// A refusal means these two peers cannot talk as configured: retrying
    /// the same pair fails again.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Config { .. } => ErrorKind::InvalidInput,
            Self::Untrusted(_) | Self::FingerprintMismatch { .. } | Self::RefusedByPeer(_) => {
                ErrorKind::VersionMismatch
            }
        }
    }
}

fn config_err(what: &'static str) -> impl Fn(String) -> TlsError {
    move |why| TlsError::Config { what, why }
}

/// A node's certificate chain (leaf first) and private key.
pub struct TlsIdentity {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Clone for TlsIdentity {
    fn clone(&self) -> Self {
        Self { chain: self.chain.clone(), key: self.key.clone_key() }
    }
}

impl fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsIdentity").field("leaf", &self.fingerprint()).field("chain", &self.chain.len()).finish()
    }
}

impl PartialEq for TlsIdentity {
    /// Same certificate chain (a chain belongs to one key).
    fn eq(&self, other: &Self) -> bool {
        self.chain == other.chain
    }
}

impl Eq for TlsIdentity {}

impl TlsIdentity {
    /// Reads a PEM certificate chain (leaf first) and a PEM private key
    /// (PKCS#8, PKCS#1 or SEC1).
    pub fn from_pem_files(cert_chain: impl AsRef<Path>, key: impl AsRef<Path>) -> Result<Self, TlsError> {
        let (c, k) = (cert_chain.as_ref(), key.as_ref());
        let chain = CertificateDer::pem_file_iter(c)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| config_err("certificate file")(format!("{}: {e}", c.display())))?;
        let key =
            PrivateKeyDer::from_pem_file(k).map_err(|e| config_err("key file")(format!("{}: {e}", k.display())))?;
        Self::new(chain, key)
    }

    /// The same from PEM text.
    pub fn from_pem(cert_chain: &[u8], key: &[u8]) -> Result<Self, TlsError> {
        let chain = CertificateDer::pem_slice_iter(cert_chain)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| config_err("certificate PEM")(e.to_string()))?;
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| config_err("key PEM")(e.to_string()))?;
        Self::new(chain, key)
    }

    /// A certificate chain (leaf first) and its key, DER.
    pub fn new(chain: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>) -> Result<Self, TlsError> {
        if chain.is_empty() {
            return Err(config_err("certificate")("no certificate found".into()));
        }
        let id = Self { chain, key };
        // Fails now, not at the first handshake, if the key is not the leaf's.
        let provider = provider();
        let signing =
            provider.key_provider.load_private_key(id.key.clone_key()).map_err(|e| config_err("key")(e.to_string()))?;
        rustls::sign::CertifiedKey::new(id.chain.clone(), signing)
            .keys_match()
            .map_err(|e| config_err("key")(format!("does not match the certificate: {e}")))?;
        Ok(id)
    }

    /// A fresh self-signed certificate for `names` (DNS names or IP
    /// addresses), for development with [`PeerTrust::Pinned`].
    pub fn self_signed(names: &[&str]) -> Result<Self, TlsError> {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let ck = rcgen::generate_simple_self_signed(names)
            .map_err(|e| config_err("self-signed certificate")(e.to_string()))?;
        let key = PrivateKeyDer::try_from(ck.signing_key.serialize_der())
            .map_err(|e| config_err("self-signed certificate")(e.to_string()))?;
        Self::new(vec![ck.cert.der().clone()], key)
    }

    /// The leaf certificate's fingerprint: what a sender pins.
    pub fn fingerprint(&self) -> CertFingerprint {
        CertFingerprint::of(&self.chain[0])
    }

    /// The certificate chain, leaf first.
    pub fn cert_chain(&self) -> &[CertificateDer<'static>] {
        &self.chain
    }

    fn parts(&self) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        (self.chain.clone(), self.key.clone_key())
    }
}

/// How a node decides whether to trust its peer's certificate.
#[derive(Clone)]
pub enum PeerTrust {
    /// The peer's chain must lead to one of these CA certificates.
    Ca(Arc<RootCertStore>),
    /// The peer's leaf certificate must be exactly this one.
    Pinned(CertFingerprint),
}

impl fmt::Debug for PeerTrust {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ca(roots) => write!(f, "Ca({} roots)", roots.len()),
            Self::Pinned(fp) => write!(f, "Pinned({fp})"),
        }
    }
}

impl PartialEq for PeerTrust {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Ca(a), Self::Ca(b)) => a.roots == b.roots,
            (Self::Pinned(a), Self::Pinned(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for PeerTrust {}

impl PeerTrust {
    /// Trusts the CA certificates in a PEM file.
    pub fn ca_from_pem_file(path: impl AsRef<Path>) -> Result<Self, TlsError> {
        let p = path.as_ref();
        let certs = CertificateDer::pem_file_iter(p)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| config_err("CA file")(format!("{}: {e}", p.display())))?;
        Self::ca(certs)
    }

    /// Trusts these CA certificates (DER).
    pub fn ca(certs: Vec<CertificateDer<'static>>) -> Result<Self, TlsError> {
        let mut roots = RootCertStore::empty();
        for c in certs {
            roots.add(c).map_err(|e| config_err("CA certificate")(e.to_string()))?;
        }
        if roots.is_empty() {
            return Err(config_err("CA certificate")("no certificate found".into()));
        }
        Ok(Self::Ca(Arc::new(roots)))
    }
}

/// ring, with AES-128-GCM preferred: as strong as needed for KV in
/// flight, and ~30% cheaper per byte than AES-256-GCM (10 rounds, not 14).
pub(crate) fn provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites.sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(p)
}

/// Where a verifier leaves the reason it refused a peer.
pub(crate) type Refusal = Arc<Mutex<Option<TlsError>>>;

fn record(slot: &Refusal, e: TlsError) {
    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
}

pub(crate) fn take_refusal(slot: &Refusal) -> Option<TlsError> {
    slot.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// The sender's TLS config: checks the decode worker as `trust` says,
/// presents `identity` if the decode worker asks for a client certificate.
pub(crate) fn client_config(
    trust: &PeerTrust,
    identity: Option<&TlsIdentity>,
    refusal: Refusal,
) -> Result<rustls::ClientConfig, TlsError> {
    let provider = provider();
    let check = match trust {
        PeerTrust::Ca(roots) => Check::Ca(
            WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone())
                .build()
                .map_err(|e| config_err("CA trust")(e.to_string()))?,
        ),
        PeerTrust::Pinned(fp) => Check::Pinned(*fp),
    };
    let verifier = Arc::new(Verifier { check, provider: provider.clone(), refusal });
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| config_err("TLS versions")(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let mut config = match identity {
        Some(id) => {
            let (chain, key) = id.parts();
            builder.with_client_auth_cert(chain, key).map_err(|e| config_err("client certificate")(e.to_string()))?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(config)
}

/// The decode worker's TLS config: presents `identity`; with `client_trust`,
/// requires and checks a client certificate.
pub(crate) fn server_config(
    identity: &TlsIdentity,
    client_trust: Option<&PeerTrust>,
    refusal: Refusal,
) -> Result<rustls::ServerConfig, TlsError> {
    let provider = provider();
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| config_err("TLS versions")(e.to_string()))?;
    let check: Option<Check<dyn ClientCertVerifier>> = match client_trust {
        None => None,
        Some(PeerTrust::Ca(roots)) => Some(Check::Ca(
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
                .build()
                .map_err(|e| config_err("client CA trust")(e.to_string()))?,
        )),
        Some(PeerTrust::Pinned(fp)) => Some(Check::Pinned(*fp)),
    };
    let builder = match check {
        None => builder.with_no_client_auth(),
        Some(check) => builder.with_client_cert_verifier(Arc::new(Verifier { check, provider, refusal })),
    };
    let (chain, key) = identity.parts();
    let mut config = builder.with_single_cert(chain, key).map_err(|e| config_err("certificate")(e.to_string()))?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(config)
}

/// How one side checks its peer's certificate: with rustls' CA verifier
/// (`V`: the server or the client one), or against a pin.
#[derive(Debug)]
enum Check<V: ?Sized> {
    Ca(Arc<V>),
    Pinned(CertFingerprint),
}

/// Checks a peer's certificate and records why it refused one; handshake
/// signatures are verified with the provider's algorithms either way.
#[derive(Debug)]
struct Verifier<V: ?Sized> {
    check: Check<V>,
    provider: Arc<CryptoProvider>,
    refusal: Refusal,
}

impl<V: ?Sized> Verifier<V> {
    /// `ca` runs the CA check; a pin is compared here.
    fn judge(
        &self,
        end_entity: &CertificateDer<'_>,
        ca: impl FnOnce(&V) -> Result<(), rustls::Error>,
    ) -> Result<(), rustls::Error> {
        let verdict = match &self.check {
            Check::Ca(v) => ca(v).map_err(|e| (TlsError::Untrusted(e.to_string()), e)),
            Check::Pinned(expected) => {
                let got = CertFingerprint::of(end_entity);
                // The alert the peer gets: "unknown CA", a certificate we do not trust.
                let alert = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
                if got == *expected {
                    Ok(())
                } else {
                    Err((TlsError::FingerprintMismatch { expected: *expected, got }, alert))
                }
            }
        };
        verdict.map_err(|(why, alert)| {
            record(&self.refusal, why);
            alert
        })
    }

    fn algorithms(&self) -> &WebPkiSupportedAlgorithms {
        &self.provider.signature_verification_algorithms
    }
}

/// The handshake-signature methods both verifier traits declare.
macro_rules! signature_checks {
    () => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls12_signature(message, cert, dss, self.algorithms())
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls13_signature(message, cert, dss, self.algorithms())
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.algorithms().supported_schemes()
        }
    };
}

impl ServerCertVerifier for Verifier<WebPkiServerVerifier> {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.judge(end_entity, |v| {
            v.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now).map(|_| ())
        })
        .map(|()| ServerCertVerified::assertion())
    }

    signature_checks!();
}

impl ClientCertVerifier for Verifier<dyn ClientCertVerifier> {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        match &self.check {
            Check::Ca(v) => v.root_hint_subjects(),
            Check::Pinned(_) => &[],
        }
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.judge(end_entity, |v| v.verify_client_cert(end_entity, intermediates, now).map(|_| ()))
            .map(|()| ClientCertVerified::assertion())
    }

    signature_checks!();
}
