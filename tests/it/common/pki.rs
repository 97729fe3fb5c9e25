//! A scratch PKI for TLS tests, made by the `openssl` CLI in a temporary directory.

use std::path::PathBuf;
use std::process::Command;

use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::pki_types::pem::PemObject;

/// The extensions of the certificates the tests make, for `openssl -config/-extfile`.
const OPENSSL_CNF: &str = "\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[both]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth,clientAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
";

/// A certificate and its key, as PEM files.
#[derive(Clone, Debug)]
pub struct Issued {
    /// The certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
}

impl Issued {
    /// The certificate file's contents.
    pub fn cert_pem(&self) -> Vec<u8> {
        std::fs::read(&self.cert).expect("read cert")
    }

    /// The key file's contents.
    pub fn key_pem(&self) -> Vec<u8> {
        std::fs::read(&self.key).expect("read key")
    }

    /// The DER of the (first) certificate.
    pub fn der(&self) -> CertificateDer<'static> {
        CertificateDer::from_pem_file(&self.cert).expect("PEM certificate")
    }
}

/// Which extensions a leaf certificate gets.
#[derive(Clone, Copy)]
pub enum Leaf {
    /// serverAuth, for 127.0.0.1 and localhost.
    Server,
    /// clientAuth.
    Client,
    /// Both, for 127.0.0.1 and localhost: one certificate serving and connecting, as Envoy
    /// Gateway mounts one `tls.crt` for both.
    ServerAndClient,
}

/// A scratch PKI in a temporary directory, driven through the `openssl` CLI.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    /// An empty PKI in a new temporary directory.
    pub fn new() -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("openssl.cnf"), OPENSSL_CNF).expect("write cnf");
        Pki { dir }
    }

    /// A file in the PKI's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn openssl(&self, args: &[&str]) {
        let output = Command::new("openssl")
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .expect("the openssl CLI is installed");
        assert!(
            output.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    fn key(&self, name: &str) -> PathBuf {
        let key = format!("{name}.key");
        self.openssl(&[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            &key,
        ]);
        self.path(&key)
    }

    /// A self-signed CA named `name`.
    pub fn ca(&self, name: &str) -> Issued {
        let key = self.key(name);
        let cert = format!("{name}.crt");
        self.openssl(&[
            "req",
            "-new",
            "-x509",
            "-key",
            &format!("{name}.key"),
            "-subj",
            &format!("/CN={name}"),
            "-days",
            "2",
            "-set_serial",
            "1",
            "-config",
            "openssl.cnf",
            "-extensions",
            "ca",
            "-out",
            &cert,
        ]);
        Issued {
            cert: self.path(&cert),
            key,
        }
    }

    /// A leaf certificate named `name` (its CN), signed by `ca`, with serial `serial`.
    pub fn issue(&self, ca: &Issued, name: &str, leaf: Leaf, serial: u32) -> Issued {
        let key = self.key(name);
        let (csr, cert) = (format!("{name}.csr"), format!("{name}.crt"));
        self.openssl(&[
            "req",
            "-new",
            "-key",
            &format!("{name}.key"),
            "-subj",
            &format!("/CN={name}"),
            "-config",
            "openssl.cnf",
            "-out",
            &csr,
        ]);
        let ca_cert = ca.cert.to_str().expect("utf-8 path");
        let ca_key = ca.key.to_str().expect("utf-8 path");
        let extensions = match leaf {
            Leaf::Server => "server",
            Leaf::Client => "client",
            Leaf::ServerAndClient => "both",
        };
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            ca_cert,
            "-CAkey",
            ca_key,
            "-set_serial",
            &serial.to_string(),
            "-days",
            "2",
            "-extfile",
            "openssl.cnf",
            "-extensions",
            extensions,
            "-out",
            &cert,
        ]);
        Issued {
            cert: self.path(&cert),
            key,
        }
    }
}
