//! How the client reaches an etcd that wants more than plain HTTP: TLS
//! (`etcds://` stores) and etcd's users, both set by environment
//! variables, so that a launcher, its workers and the launchers it starts
//! on other hosts read the same ones:
//!
//! | variable | what |
//! |---|---|
//! | `KUNGFU_ETCD_CA` | PEM file of the CA(s) that signed etcd's certificate (`etcds://` needs it) |
//! | `KUNGFU_ETCD_CERT`, `KUNGFU_ETCD_KEY` | PEM files of a client certificate and its key, for an etcd with `--client-cert-auth` |
//! | `KUNGFU_ETCD_USER` | an etcd user to authenticate as |
//! | `KUNGFU_ETCD_PASSWORD_FILE` | the file that holds its password (one line) |
//!
//! The password is read from a file, never from the environment or a
//! command line, which other users of the machine may see, and sent only
//! over TLS (a user with an `etcd://` store is refused). TLS is 1.3 with
//! etcd's certificate checked against the CA and the address's host name.
//!
//! The environment is read once per process ([`Access::from_env`]), and
//! every store opened from it shares one user's token, so that a worker
//! that opens its store at every resize logs in once, not every time.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// The CA that signed etcd's certificate (PEM).
pub const ENV_CA: &str = "KUNGFU_ETCD_CA";
/// A client certificate (PEM).
pub const ENV_CERT: &str = "KUNGFU_ETCD_CERT";
/// The client certificate's private key (PEM).
pub const ENV_KEY: &str = "KUNGFU_ETCD_KEY";
/// The etcd user to authenticate as.
pub const ENV_USER: &str = "KUNGFU_ETCD_USER";
/// The file that holds the user's password.
pub const ENV_PASSWORD_FILE: &str = "KUNGFU_ETCD_PASSWORD_FILE";
/// Every variable of the access, as a launcher hands them on.
pub const ACCESS_VARS: [&str; 5] = [ENV_CA, ENV_CERT, ENV_KEY, ENV_USER, ENV_PASSWORD_FILE];

/// The longest password file read.
const MAX_PASSWORD: u64 = 4096;

/// TLS to one etcd member.
#[derive(Clone)]
pub(super) struct Tls {
    pub config: Arc<rustls::ClientConfig>,
    pub name: ServerName<'static>,
}

/// An etcd user, and the token etcd gave it last.
pub(super) struct Auth {
    pub user: String,
    pub password: String,
    pub token: Mutex<Option<String>>,
    /// How many tokens etcd gave it.
    pub logins: AtomicU64,
}

impl Auth {
    pub fn logged_in(&self, token: &str) {
        *self.token.lock().unwrap() = Some(token.to_string());
        self.logins.fetch_add(1, Ordering::Relaxed);
    }
}

/// What the client needs beyond an address: TLS, a user, or neither.
#[derive(Clone, Default)]
pub struct Access {
    tls: Option<TlsFiles>,
    user: Option<Arc<Auth>>,
}

#[derive(Clone)]
struct TlsFiles {
    roots: Arc<rustls::RootCertStore>,
    client: Option<(Vec<CertificateDer<'static>>, Arc<PrivateKeyDer<'static>>)>,
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the password or the key
        f.debug_struct("Access")
            .field("tls", &self.tls.is_some())
            .field("user", &self.user.as_ref().map(|u| &u.user))
            .finish()
    }
}

fn certs(p: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let v: Vec<_> = CertificateDer::pem_file_iter(p)
        .and_then(|i| i.collect::<Result<_, _>>())
        .map_err(|e| format!("{what} {}: {e}", p.display()))?;
    if v.is_empty() {
        return Err(format!("{what} {}: no certificate in it", p.display()));
    }
    Ok(v)
}

impl Access {
    /// The access the environment sets (the variables above), for a store
    /// reached over TLS (`tls`, `etcds://`) or not (`etcd://`, where the
    /// TLS variables are refused rather than ignored).
    /// Read once per process and kept (the token with it).
    pub fn from_env(tls: bool) -> Result<Access, String> {
        static READ: OnceLock<[Result<Access, String>; 2]> = OnceLock::new();
        let read = READ.get_or_init(|| {
            [false, true].map(|tls| Access::from_vars(tls, |k| std::env::var_os(k)))
        });
        read[tls as usize].clone()
    }

    /// [`Access::from_env`], with the variables from `var`.
    pub fn from_vars(tls: bool, var: impl Fn(&str) -> Option<OsString>) -> Result<Access, String> {
        let path = |k: &str| var(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let (ca, cert, key) = (path(ENV_CA), path(ENV_CERT), path(ENV_KEY));
        let tls = match (tls, ca) {
            (false, None) if cert.is_none() && key.is_none() => None,
            (false, _) => {
                return Err(format!(
                    "{ENV_CA}, {ENV_CERT} and {ENV_KEY} are for TLS: name the store etcds://HOST:PORT/..."
                ))
            }
            (true, None) => {
                return Err(format!(
                    "an etcds:// store needs {ENV_CA}: the PEM file of the CA that signed etcd's certificate"
                ))
            }
            (true, Some(ca)) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in certs(&ca, ENV_CA)? {
                    roots
                        .add(c)
                        .map_err(|e| format!("{ENV_CA} {}: {e}", ca.display()))?;
                }
                let client = match (cert, key) {
                    (None, None) => None,
                    (Some(cert), Some(key)) => {
                        let k = PrivateKeyDer::from_pem_file(&key)
                            .map_err(|e| format!("{ENV_KEY} {}: {e}", key.display()))?;
                        Some((certs(&cert, ENV_CERT)?, Arc::new(k)))
                    }
                    _ => return Err(format!("{ENV_CERT} and {ENV_KEY} go together")),
                };
                Some(TlsFiles {
                    roots: Arc::new(roots),
                    client,
                })
            }
        };
        let user = match (
            var(ENV_USER).filter(|v| !v.is_empty()),
            path(ENV_PASSWORD_FILE),
        ) {
            (None, None) => None,
            (Some(_), Some(_)) if tls.is_none() => {
                return Err(format!(
                    "{ENV_USER} over etcd:// would send the password in clear: name the store etcds://HOST:PORT/..."
                ))
            }
            (Some(u), Some(p)) => {
                let u = u
                    .into_string()
                    .map_err(|_| format!("{ENV_USER} is not UTF-8"))?;
                Some(Arc::new(Auth {
                    user: u,
                    password: read_password(&p)?,
                    token: Mutex::new(None),
                    logins: AtomicU64::new(0),
                }))
            }
            _ => return Err(format!("{ENV_USER} and {ENV_PASSWORD_FILE} go together")),
        };
        Ok(Access { tls, user })
    }

    /// Whether the store is reached over TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The TLS of a connection to `addr` (`host:port`), if any.
    pub(super) fn tls_for(&self, addr: &str) -> Result<Option<Tls>, String> {
        let Some(t) = &self.tls else {
            return Ok(None);
        };
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| format!("{host:?} is no name for TLS: {e}"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| format!("TLS: {e}"))?
            .with_root_certificates(t.roots.clone());
        let config = match &t.client {
            None => builder.with_no_client_auth(),
            Some((chain, key)) => builder
                .with_client_auth_cert(chain.clone(), key.clone_key())
                .map_err(|e| format!("{ENV_CERT}/{ENV_KEY}: {e}"))?,
        };
        Ok(Some(Tls {
            config: Arc::new(config),
            name,
        }))
    }

    /// The user to authenticate as, if any (shared by every store of
    /// this access, with its token).
    pub(super) fn auth(&self) -> Option<Arc<Auth>> {
        self.user.clone()
    }

    /// How many times this access's user logged in (got a token).
    pub fn logins(&self) -> u64 {
        self.user
            .as_ref()
            .map_or(0, |a| a.logins.load(Ordering::Relaxed))
    }
}

/// The password in file `p`: its first line, which must not be empty.
fn read_password(p: &Path) -> Result<String, String> {
    use std::io::Read;
    let what = |e: &dyn std::fmt::Display| format!("{ENV_PASSWORD_FILE} {}: {e}", p.display());
    let mut text = String::new();
    std::fs::File::open(p)
        .and_then(|f| f.take(MAX_PASSWORD + 1).read_to_string(&mut text))
        .map_err(|e| what(&e))?;
    if text.len() as u64 > MAX_PASSWORD {
        return Err(what(&format!("over {MAX_PASSWORD} bytes")));
    }
    let line = text.lines().next().unwrap_or("");
    if line.is_empty() {
        return Err(what(&"empty"));
    }
    Ok(line.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &Path)]) -> impl Fn(&str) -> Option<OsString> {
        let m: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_os_str().to_owned()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn the_variables_are_checked_and_named() {
        let dir = std::env::temp_dir().join(format!("kungfu-etcd-access-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (pw, empty, missing) = (dir.join("pw"), dir.join("empty"), dir.join("missing"));
        std::fs::write(&pw, "s3cret\nignored\n").unwrap();
        std::fs::write(&empty, "\n").unwrap();
        let ca = dir.join("ca.pem");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["etcd".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        std::fs::write(&ca, cert.pem()).unwrap();
        let key_file = dir.join("key.pem");
        std::fs::write(&key_file, key.serialize_pem()).unwrap();

        let none = Access::from_vars(false, vars(&[])).unwrap();
        assert!(!none.is_tls() && none.auth().is_none());
        let err = |tls, v: &[(&str, &Path)]| Access::from_vars(tls, vars(v)).unwrap_err();
        assert!(err(true, &[]).contains(ENV_CA));
        assert!(err(false, &[(ENV_CA, &ca)]).contains("etcds://"));
        assert!(err(true, &[(ENV_CA, &missing)]).contains("missing"));
        assert!(err(true, &[(ENV_CA, &pw)]).contains("no certificate"));
        assert!(err(true, &[(ENV_CA, &ca), (ENV_CERT, &ca)]).contains("go together"));
        let u = Path::new("kf");
        let tls = (ENV_CA, ca.as_path());
        assert!(err(true, &[tls, (ENV_USER, u)]).contains(ENV_PASSWORD_FILE));
        assert!(err(true, &[tls, (ENV_USER, u), (ENV_PASSWORD_FILE, &empty)]).contains("empty"));
        assert!(
            err(true, &[tls, (ENV_USER, u), (ENV_PASSWORD_FILE, &missing)]).contains("missing")
        );
        // a password never goes in clear
        assert!(err(false, &[(ENV_USER, u), (ENV_PASSWORD_FILE, &pw)]).contains("in clear"));

        let a = Access::from_vars(
            true,
            vars(&[
                (ENV_CA, &ca),
                (ENV_CERT, &ca),
                (ENV_KEY, &key_file),
                (ENV_USER, u),
                (ENV_PASSWORD_FILE, &pw),
            ]),
        )
        .unwrap();
        assert!(a.is_tls());
        let auth = a.auth().unwrap();
        assert_eq!(
            (auth.user.as_str(), auth.password.as_str()),
            ("kf", "s3cret")
        );
        assert!(!format!("{a:?}").contains("s3cret"));
        assert!(a.tls_for("127.0.0.1:2379").unwrap().is_some());
        assert!(a.tls_for("[::1]:2379").unwrap().is_some());
        assert!(a.tls_for("etcd.example:2379").unwrap().is_some());
        assert!(a.tls_for("bad host:1").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
