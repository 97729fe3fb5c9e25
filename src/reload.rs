//! Hot reload: re-read the config when its files change or on SIGHUP, and swap it in only when
//! it is valid, so a bad edit never takes effect.
//!
//! Changes are found by hashing the contents of the files [`config::load_path`] would read, once
//! per interval. This sees Kubernetes ConfigMap updates (an atomic `..data` symlink swap that
//! replaces no watched inode), editors that write a new file and rename it, and mounts where
//! inotify events never arrive, at the cost of reading a few kilobytes a second.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::config::{self, Config, ConfigErrors, LoadOptions};
use crate::metrics::Metrics;

/// Keeps a live config in step with its files.
pub struct Reloader {
    path: PathBuf,
    options: LoadOptions,
    config: Arc<ArcSwap<Config>>,
    metrics: Arc<Metrics>,
    /// Fingerprint of the files last loaded (or last rejected), so one change is tried once.
    seen: Mutex<Option<u64>>,
}

/// What a reload did.
#[derive(Debug)]
pub enum Reload {
    /// The new config is live.
    Swapped {
        /// Domains it has.
        domains: usize,
    },
    /// The files did not change since the last load.
    Unchanged,
    /// The new files are invalid; the previous config stays.
    Rejected(ConfigErrors),
}

impl Reloader {
    /// A reloader for the config at `path`, read with `options`, which is already loaded into
    /// `config`.
    pub fn new(
        path: PathBuf,
        options: LoadOptions,
        config: Arc<ArcSwap<Config>>,
        metrics: Arc<Metrics>,
    ) -> Reloader {
        let seen = fingerprint(&path, options);
        Reloader {
            path,
            options,
            config,
            metrics,
            seen: Mutex::new(seen),
        }
    }

    /// Reloads if the files changed since the last attempt.
    pub fn reload_if_changed(&self) -> Reload {
        let now = fingerprint(&self.path, self.options);
        {
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            // An unreadable moment (a directory mid-swap) is not a change: wait for it to settle.
            if now.is_none() || *seen == now {
                return Reload::Unchanged;
            }
            *seen = now;
        }
        self.reload()
    }

    /// Loads and validates the files; swaps the new config in only if all of it is valid and
    /// it has a domain (a directory emptied by accident would lift every limit; see
    /// [`config::empty_config_error`]). Requests in flight keep the snapshot they started with.
    pub fn reload(&self) -> Reload {
        let loaded = config::load_path(&self.path, self.options).and_then(|loaded| {
            match config::empty_config_error(&self.path, &loaded) {
                Some(error) => Err(ConfigErrors(vec![error])),
                None => Ok(loaded),
            }
        });
        match loaded {
            Ok(loaded) => {
                let domains = loaded.domains.len();
                config::warn_about_unread(&self.path, self.options);
                self.config.store(Arc::new(loaded));
                tracing::info!(path = %self.path.display(), domains, "config reloaded");
                self.metrics.config_load_success.inc();
                Reload::Swapped { domains }
            }
            Err(errors) => {
                // Logged before it is counted, so whoever sees the count finds the reason. An
                // error: the files on disk are not what is enforced.
                tracing::error!(
                    path = %self.path.display(),
                    "config reload rejected, keeping the previous config:\n{errors}"
                );
                self.metrics.config_load_error.inc();
                Reload::Rejected(errors)
            }
        }
    }

    /// Checks for changes every `interval` (never, if zero) and reloads on SIGHUP, forever.
    pub async fn watch(self: Arc<Self>, interval: Duration) {
        #[cfg(unix)]
        let mut hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        {
            Ok(signal) => Some(signal),
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGHUP");
                None
            }
        };
        let mut tick = (!interval.is_zero()).then(|| tokio::time::interval(interval));
        loop {
            let polled = async {
                match tick.as_mut() {
                    Some(tick) => {
                        tick.tick().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            #[cfg(unix)]
            let hung_up = async {
                match hangup.as_mut() {
                    Some(signal) => {
                        signal.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            #[cfg(not(unix))]
            let hung_up = std::future::pending::<()>();
            let this = Arc::clone(&self);
            tokio::select! {
                () = polled => {
                    let _ = tokio::task::spawn_blocking(move || this.reload_if_changed()).await;
                }
                () = hung_up => {
                    tracing::info!("SIGHUP received, reloading config");
                    let _ = tokio::task::spawn_blocking(move || {
                        *this.seen.lock().unwrap_or_else(PoisonError::into_inner) = fingerprint(&this.path, this.options);
                        this.reload()
                    })
                    .await;
                }
            }
        }
    }
}

/// A hash of the names and contents of the config files; `None` if they cannot all be read.
fn fingerprint(path: &std::path::Path, options: LoadOptions) -> Option<u64> {
    let files = config::config_files(path, options).ok()?;
    let mut hasher = DefaultHasher::new();
    for file in files {
        file.hash(&mut hasher);
        std::fs::read(&file).ok()?.hash(&mut hasher);
    }
    Some(hasher.finish())
}
