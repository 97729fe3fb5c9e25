//! Loading config files: YAML text -> validated [`Domain`], reporting every problem of a file.
//!
//! [`yaml::parse`] turns the text into a tree where every node knows its line and column; this
//! module walks that tree into the model, recording each problem it meets and carrying on, so
//! one run reports all of a file's errors. Messages keep envoyproxy/ratelimit's wording where it
//! has one.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::fs;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};

use crate::config::model::{Config, Domain, Level, Node, PlanTable, Policy, Wildcard};
use crate::config::yaml::{self, Pos, Value};
use crate::limit::{Algorithm, Charge, Limit, Period, Unit};

mod rlqs;

/// A node of the raw YAML tree (as opposed to a [`Node`] of the config tree).
type YNode = yaml::Node;

/// One problem in a config file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}:{column}: {reason}")]
pub struct ConfigError {
    /// The file's path as given (or as found in the directory).
    pub file: String,
    /// 1-based line; 0 when the problem is not inside the file (it could not be read).
    pub line: u64,
    /// 1-based column; 0 together with line 0.
    pub column: u64,
    /// What is wrong, naming the offending key or value.
    pub reason: String,
}

/// All problems found while loading (never empty when returned as `Err`).
#[derive(Debug, thiserror::Error)]
#[error("{}", one_per_line(.0))]
pub struct ConfigErrors(pub Vec<ConfigError>);

/// Formats errors one per line.
fn one_per_line(errors: &[ConfigError]) -> String {
    let mut out = String::new();
    for (i, error) in errors.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let _ = write!(out, "{error}");
    }
    out
}

/// How a config directory is read, and how its files combine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Read files and directories whose names start with `.` too (envoyproxy/ratelimit's
    /// `RUNTIME_IGNOREDOTFILES=false`); by default they are skipped.
    pub dotfiles: bool,
    /// Files naming the same domain add their descriptors to it (envoyproxy/ratelimit's
    /// `MERGE_DOMAIN_CONFIG=true`) instead of the second being refused.
    pub merge_domains: bool,
}

/// Loads a config file, or every file below a directory (see [`config_files`]).
///
/// Every file is checked even when an earlier one has errors.
///
/// # Errors
/// Every problem of every file, each with its file, line and column, in file order.
pub fn load_path(path: &Path, options: LoadOptions) -> Result<Config, ConfigErrors> {
    let files = config_files(path, options).map_err(|error| ConfigErrors(vec![error]))?;
    load_sources(
        files.into_iter().map(|file| {
            let name = file.display().to_string();
            // Invalid UTF-8 is an `InvalidData` read error, reported like any other.
            let text = fs::read_to_string(&file).map_err(|error| unreadable(&file, &error));
            (name, text)
        }),
        options,
    )
}

/// Loads named texts (files, or resources pushed over xDS) into one config, one domain each
/// (or, with [`LoadOptions::merge_domains`], one domain from several), exactly as
/// [`load_path`] checks files: every source is checked even after an error.
///
/// # Errors
/// Every problem of every source, each named by its source, in source order.
pub fn load_sources(
    sources: impl IntoIterator<Item = (String, Result<String, ConfigError>)>,
    options: LoadOptions,
) -> Result<Config, ConfigErrors> {
    let mut errors = Vec::new();
    let mut config = Config::default();
    let mut first_file: HashMap<String, String> = HashMap::new();
    // With merging: which file gave each top-level descriptor (and `plans:`) of each domain.
    let mut origins: HashMap<String, Origins> = HashMap::new();
    // With merging: `replaces` to check once every file of their domain is in (domain, file,
    // name, position).
    let mut pending_replaces = Vec::new();
    for (name, text) in sources {
        let text = match text {
            Ok(text) => text,
            Err(error) => {
                errors.push(error);
                continue;
            }
        };
        let merge = options.merge_domains.then_some(Merge {
            domains: &mut config.domains,
            origins: &origins,
        });
        let loaded = load_file(&name, &text, merge);
        if let Some((domain, _)) = &loaded.domain {
            for (target, pos) in &loaded.unknown_replaces {
                pending_replaces.push((domain.clone(), name.clone(), target.clone(), *pos));
            }
        }
        let mut file_errors = Vec::new();
        let mut duplicate = false;
        if let Some((domain, pos)) = &loaded.domain {
            if let Some(first) = first_file.get(domain) {
                if !options.merge_domains {
                    duplicate = true;
                    file_errors.push(error_at(
                        &name,
                        *pos,
                        format!(
                            "duplicate domain '{domain}' in config file (already defined in {first})"
                        ),
                    ));
                }
            } else {
                first_file.insert(domain.clone(), name.clone());
            }
        }
        match loaded.result {
            Ok(domain) if !duplicate => {
                if options.merge_domains {
                    origins
                        .entry(domain.name.clone())
                        .or_default()
                        .record(&domain, &name);
                }
                config.domains.insert(domain.name.clone(), domain);
            }
            Ok(_) => {}
            Err(more) => {
                file_errors.extend(more);
                if let Some(partial) = loaded.partial {
                    config.domains.insert(partial.name.clone(), partial);
                }
            }
        }
        file_errors.sort_by_key(|error| (error.line, error.column));
        errors.append(&mut file_errors);
    }
    let mut names: HashMap<&str, HashSet<String>> = HashMap::new();
    for (domain, file, target, pos) in &pending_replaces {
        let Some(loaded) = config.domains.get(domain) else {
            continue;
        };
        let known = names.entry(domain.as_str()).or_insert_with(|| {
            let mut known = HashSet::new();
            limit_names(&loaded.root, &mut known);
            known
        });
        if !known.contains(target) {
            errors.push(error_at(file, *pos, unknown_replaces(target, domain)));
        }
    }
    if errors.is_empty() {
        Ok(config)
    } else {
        Err(ConfigErrors(errors))
    }
}

/// Which file gave each part of a domain merged from several.
#[derive(Default)]
struct Origins {
    /// Top-level descriptor path -> file.
    descriptors: HashMap<String, String>,
    /// The file with the domain's `plans:`.
    plans: Option<String>,
}

impl Origins {
    /// Records the parts of `domain` not yet known as coming from `file`.
    fn record(&mut self, domain: &Domain, file: &str) {
        for nodes in domain.root.keys.values() {
            for node in nodes.all() {
                self.descriptors
                    .entry(node.path.clone())
                    .or_insert_with(|| file.to_owned());
            }
        }
        if domain.plans.is_some() && self.plans.is_none() {
            self.plans = Some(file.to_owned());
        }
    }
}

/// What a file merges into: the domains loaded so far, and where their parts came from.
struct Merge<'a> {
    domains: &'a mut crate::config::model::Map<Domain>,
    origins: &'a HashMap<String, Origins>,
}

/// Loads one file's text; `file_name` is only used in errors and as [`Domain::source`].
///
/// # Errors
/// Every problem of the file, sorted by line and column.
pub fn load_str(file_name: &str, yaml: &str) -> Result<Domain, Vec<ConfigError>> {
    load_file(file_name, yaml, None).result
}

/// The files [`load_path`] reads for `path`: the file itself, or every file below the
/// directory, as envoyproxy/ratelimit's runtime loader (goruntime) finds them: whatever their
/// names, in subdirectories too, in name order depth first; names starting with `.` skipped
/// unless [`LoadOptions::dotfiles`], and names starting with `..` always (in a Kubernetes
/// `ConfigMap` mount, `name` is a symlink to `..data/name`, `..data` one to the timestamped
/// `..2026_...` directory: goruntime reading dot names reads each file twice there, and
/// envoyproxy/ratelimit refuses the duplicate domain); symlinks to files followed, symlinks to
/// directories not (goruntime cannot read them either). A file two paths reach is read once,
/// under the first path without a dot-named component.
///
/// # Errors
/// When the path or a directory below it cannot be read.
pub fn config_files(path: &Path, options: LoadOptions) -> Result<Vec<PathBuf>, ConfigError> {
    match fs::metadata(path) {
        Ok(meta) if meta.is_dir() => {
            let mut found = Vec::new();
            walk(path, options, &mut found, &mut Vec::new())?;
            Ok(read_once(path, found))
        }
        Ok(_) => Ok(vec![path.to_path_buf()]),
        Err(error) => Err(unreadable(path, &error)),
    }
}

/// The error for a config loaded from `path` without a single domain, if it has none: what a
/// directory left empty by accident holds (a ConfigMap mounted empty, a bad deploy), under which
/// every request would be answered OK. A reload refuses it and `check` fails on it; a start
/// logs it and serves without limits, having no earlier config to keep. Wanting no limits is
/// said with a file of only `domain: <name>`, which loads as a domain without limits.
pub fn empty_config_error(path: &Path, config: &Config) -> Option<ConfigError> {
    config.domains.is_empty().then(|| ConfigError {
        file: path.display().to_string(),
        line: 0,
        column: 0,
        reason: "no config file (a file with a 'domain:'): every request would be answered OK; \
                 to run without limits on purpose, load a file of only 'domain: <name>'"
            .to_owned(),
    })
}

/// Warns about entries below the directory `path` that are not read (symlinks to directories
/// outside it, and what is neither file nor directory), which make a loaded config limit less
/// than its author may think.
pub fn warn_about_unread(path: &Path, options: LoadOptions) {
    let unread = unread_files(path, options);
    if !unread.is_empty() {
        let names: Vec<String> = unread
            .iter()
            .map(|entry| entry.display().to_string())
            .collect();
        tracing::warn!(
            path = %path.display(),
            "not read, as symlinks to directories are not followed and only files are config: {}",
            names.join(", ")
        );
    }
}

/// The entries below the directory `path` that [`load_path`] does not read although their
/// names are not skipped: symlinks to directories whose files are not read some other way
/// (a `ConfigMap`'s `..data` is read through its target), and entries that are neither files
/// nor directories. None when `path` is a file or cannot be listed.
pub fn unread_files(path: &Path, options: LoadOptions) -> Vec<PathBuf> {
    let mut unread = Vec::new();
    if fs::metadata(path).is_ok_and(|meta| meta.is_dir()) {
        let _ = walk(path, options, &mut Vec::new(), &mut unread);
    }
    let root = fs::canonicalize(path).ok();
    unread.retain(|entry| {
        let inside = fs::canonicalize(entry)
            .ok()
            .zip(root.as_ref())
            .is_some_and(|(target, root)| target.starts_with(root));
        !(inside && entry.is_dir())
    });
    unread
}

/// Collects the files below `dir` in name order, depth first, into `files`, and the entries
/// left unread into `unread`.
fn walk(
    dir: &Path,
    options: LoadOptions,
    files: &mut Vec<PathBuf>,
    unread: &mut Vec<PathBuf>,
) -> Result<(), ConfigError> {
    let entries = fs::read_dir(dir).map_err(|error| unreadable(dir, &error))?;
    let mut entries = entries
        .map(|entry| entry.map_err(|error| unreadable(dir, &error)))
        .collect::<Result<Vec<_>, _>>()?;
    entries.sort_by_key(fs::DirEntry::file_name);
    for entry in entries {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        // `..` names are the kubelet's own in a ConfigMap mount (`..data`, `..2026_...`,
        // reserved by its atomic writer): their files are read through the visible symlinks,
        // and an old version left for a moment mid-swap is never read.
        if name.starts_with("..") || (!options.dotfiles && name.starts_with('.')) {
            continue;
        }
        let path = entry.path();
        let kind = entry
            .file_type()
            .map_err(|error| unreadable(&path, &error))?;
        if kind.is_dir() {
            walk(&path, options, files, unread)?;
        } else if kind.is_symlink() {
            match fs::metadata(&path) {
                Ok(target) if target.is_dir() => unread.push(path),
                Ok(target) if !target.is_file() => unread.push(path),
                // A broken symlink is kept, so reading it reports the problem.
                _ => files.push(path),
            }
        } else if kind.is_file() {
            files.push(path);
        } else {
            unread.push(path);
        }
    }
    Ok(())
}

/// `files` with each file that two paths reach (same canonical path) kept once, under the
/// first path without a dot-named component below `root`, else the first; order kept.
fn read_once(root: &Path, files: Vec<PathBuf>) -> Vec<PathBuf> {
    let hidden = |file: &Path| {
        file.strip_prefix(root).is_ok_and(|relative| {
            relative
                .components()
                .any(|part| part.as_os_str().to_string_lossy().starts_with('.'))
        })
    };
    let real: Vec<PathBuf> = files
        .iter()
        .map(|file| fs::canonicalize(file).unwrap_or_else(|_| file.clone()))
        .collect();
    let mut chosen: HashMap<&Path, usize> = HashMap::new();
    for (index, target) in real.iter().enumerate() {
        chosen
            .entry(target.as_path())
            .and_modify(|kept| {
                if hidden(&files[*kept]) && !hidden(&files[index]) {
                    *kept = index;
                }
            })
            .or_insert(index);
    }
    let keep: HashSet<usize> = chosen.into_values().collect();
    files
        .into_iter()
        .enumerate()
        .filter_map(|(index, file)| keep.contains(&index).then_some(file))
        .collect()
}

/// The error for a path that cannot be read.
fn unreadable(path: &Path, error: &std::io::Error) -> ConfigError {
    ConfigError {
        file: path.display().to_string(),
        line: 0,
        column: 0,
        reason: format!("cannot read config: {error}"),
    }
}

/// An error at a position of a file.
fn error_at(file: &str, pos: Pos, reason: String) -> ConfigError {
    ConfigError {
        file: file.to_owned(),
        line: pos.line,
        column: pos.column,
        reason,
    }
}

/// One file's outcome, plus its domain name even when the file has other errors (so duplicate
/// domains across files are still reported).
struct Loaded {
    /// The non-empty `domain:` and where its key is.
    domain: Option<(String, Pos)>,
    /// The domain, or every error of the file sorted by position.
    result: Result<Domain, Vec<ConfigError>>,
    /// When merging and the file has errors: the domain with what of it is valid, so later
    /// files of the domain are still checked against it.
    partial: Option<Domain>,
    /// When merging: `replaces` names no limit of the domain has so far, and where each is.
    unknown_replaces: Vec<(String, Pos)>,
}

/// Stack for parsing and walking a file: both recurse once per nesting level (serde-saphyr stops
/// at 64), which overflows a 2 MiB thread stack in debug builds long before that.
const LOAD_STACK_BYTES: usize = 64 * 1024 * 1024;

/// Parses and validates one file, on a thread with a stack deep enough for any nesting the
/// parser accepts, so a deeply nested file is an error and never a crash.
fn load_file(file: &str, text: &str, mut merge: Option<Merge<'_>>) -> Loaded {
    std::thread::scope(|scope| {
        let merge = merge.as_mut().map(Merge::reborrow);
        std::thread::Builder::new()
            .name("rlsd-config".to_owned())
            .stack_size(LOAD_STACK_BYTES)
            .spawn_scoped(scope, || load_file_here(file, text, merge))
            .ok()
            .and_then(|loading| loading.join().ok())
    })
    // Without a thread (none could be spawned, or it panicked), load here.
    .unwrap_or_else(|| load_file_here(file, text, merge))
}

impl Merge<'_> {
    /// The same merge, for a shorter while.
    fn reborrow(&mut self) -> Merge<'_> {
        Merge {
            domains: self.domains,
            origins: self.origins,
        }
    }
}

fn load_file_here(file: &str, text: &str, merge: Option<Merge<'_>>) -> Loaded {
    let root = match yaml::parse(text) {
        Ok(root) => root,
        Err(error) => {
            let (pos, message) = yaml::describe_error(&error);
            return Loaded {
                domain: None,
                result: Err(vec![error_at(
                    file,
                    pos,
                    format!("invalid YAML: {message}"),
                )]),
                partial: None,
                unknown_replaces: Vec::new(),
            };
        }
    };
    let mut walker = Walker {
        file,
        text,
        errors: Vec::new(),
        domain: String::new(),
        limit_names: HashSet::new(),
        replaces_refs: Vec::new(),
        layers: None,
        shares_thresholds: false,
        values_in_metrics: false,
        merge,
        base: None,
        quota: Default::default(),
    };
    let (domain, root, plans) = walker.file(&root);
    let unknown_replaces = walker.check_replaces();
    let mut errors = std::mem::take(&mut walker.errors);
    let (source, plans, quota) = match walker.base.take() {
        Some(base) => (
            format!("{}, {file}", base.source),
            plans.or(base.plans),
            base.quota,
        ),
        None => (file.to_owned(), plans, None),
    };
    let quota = quota.unwrap_or_else(|| std::mem::take(&mut walker.quota));
    let merging = walker.merge.is_some();
    let built = domain.as_ref().map(|(name, _)| Domain {
        name: name.clone(),
        source,
        root,
        plans,
        shares_thresholds: walker.shares_thresholds,
        values_in_metrics: walker.values_in_metrics,
        quota,
    });
    let (result, partial) = match built {
        Some(built) if errors.is_empty() => (Ok(built), None),
        built => {
            errors.sort_by_key(|error| (error.line, error.column));
            (Err(errors), built.filter(|_| merging))
        }
    };
    Loaded {
        domain,
        result,
        partial,
        unknown_replaces,
    }
}

/// The error for a `replaces` of a name no limit of `domain` has.
fn unknown_replaces(name: &str, domain: &str) -> String {
    format!("replaces unknown limit name '{name}' (no limit in domain '{domain}' has that name)")
}

/// Collects the name of every limit in `level` and below.
fn limit_names(level: &Level, names: &mut HashSet<String>) {
    for node in level
        .keys
        .values()
        .flat_map(crate::config::model::KeyNodes::all)
    {
        match &node.policy {
            Some(Policy::Limits(limits)) => {
                names.extend(limits.iter().filter_map(|limit| limit.name.clone()));
            }
            Some(Policy::Unlimited {
                name: Some(name), ..
            }) => {
                names.insert(name.clone());
            }
            _ => {}
        }
        limit_names(&node.children, names);
    }
}

/// Keys allowed at the top of a file.
const FILE_KEYS: &[&str] = &["domain", "layers", "plans", "descriptors", "quota_buckets"];
/// The longest period a limit may have: ten years keeps every microsecond sum well inside what
/// Lua's doubles (and so the Redis store) count exactly.
const MAX_PERIOD_SECONDS: u64 = 10 * 365 * 86_400;
/// The largest sliding log: it stores up to one entry per request in its window, so its memory
/// grows with L.
const MAX_SLIDING_LOG_LIMIT: u32 = 100_000;
/// Longest GCRA burst tolerance `(B - 1) * P / L`, in microseconds (ten years), for the same
/// reason as the period.
const MAX_GCRA_TOLERANCE_US: u128 = MAX_PERIOD_SECONDS as u128 * 1_000_000;

/// Why a limit's numbers are too large to decide exactly, if they are.
fn magnitude_problem(
    algorithm: Algorithm,
    limit: u32,
    burst: Option<NonZeroU32>,
    period: Period,
) -> Option<String> {
    let seconds = period.unit.seconds() * u64::from(period.multiplier.get());
    if seconds > MAX_PERIOD_SECONDS {
        return Some(format!(
            "the period ({seconds} s) is longer than ten years; use a smaller unit_multiplier"
        ));
    }
    if algorithm == Algorithm::SlidingWindowLog && limit > MAX_SLIDING_LOG_LIMIT {
        return Some(format!(
            "sliding_window_log keeps one entry per hit: requests_per_unit {limit} is above {MAX_SLIDING_LOG_LIMIT}; \
             use sliding_window_counter for large limits"
        ));
    }
    if algorithm == Algorithm::Gcra && limit > 0 {
        let burst = u128::from(burst.map_or(1, NonZeroU32::get));
        let tolerance = (burst - 1) * u128::from(seconds) * 1_000_000 / u128::from(limit);
        if tolerance > MAX_GCRA_TOLERANCE_US {
            return Some(format!(
                "gcra burst {burst} at {limit} per {seconds} s tolerates more than ten years of requests; lower the burst"
            ));
        }
    }
    None
}

/// Keys allowed in `plans:`.
const PLANS_KEYS: &[&str] = &["from", "entry", "default", "keys"];
/// Keys allowed in a descriptor.
const DESCRIPTOR_KEYS: &[&str] = &[
    "key",
    "value",
    "layer",
    "rate_limit",
    "rate_limits",
    "shadow_mode",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "quota_mode",
    "metadata",
    "descriptors",
];
/// Keys allowed in a rate limit.
const LIMIT_KEYS: &[&str] = &[
    "unit",
    "requests_per_unit",
    "unlimited",
    "name",
    "replaces",
    "algorithm",
    "burst",
    "unit_multiplier",
    "shadow_mode",
    "charge",
];
/// Keys allowed in a `replaces` entry.
const REPLACES_KEYS: &[&str] = &["name"];
/// Rate limit keys that make no sense with `unlimited: true`. `requests_per_unit` and
/// `replaces` are allowed there, as envoyproxy/ratelimit allows them (the count is ignored).
const LIMITED_ONLY_KEYS: &[&str] = &[
    "unit",
    "algorithm",
    "burst",
    "unit_multiplier",
    "shadow_mode",
    "charge",
];

/// A mapping's known entries, after its unknown keys have been reported.
struct Fields<'n> {
    /// `(key name, key node, value node)` in file order.
    entries: Vec<(&'static str, &'n YNode, &'n YNode)>,
}

impl<'n> Fields<'n> {
    /// The key and value of `name`, even when the value is null.
    fn raw(&self, name: &str) -> Option<(&'n YNode, &'n YNode)> {
        self.entries
            .iter()
            .find(|(known, _, _)| *known == name)
            .map(|(_, key, value)| (*key, *value))
    }

    /// The key and value of `name`; a null value (`name:` or `name: ~`) counts as absent.
    fn get(&self, name: &str) -> Option<(&'n YNode, &'n YNode)> {
        self.raw(name)
            .filter(|(_, value)| !matches!(value.value, Value::Null))
    }
}

/// A rate limit as parsed, before it is placed on its descriptor.
struct ParsedLimit {
    /// The limit, or `None` for `unlimited: true`.
    limit: Option<Limit>,
    /// Its `name`, if non-empty.
    name: Option<String>,
    /// `replaces` names and where each is written.
    replaces: Vec<(String, Pos)>,
    /// Where the limit is written.
    pos: Pos,
}

/// Walks one file's YAML tree, collecting errors.
struct Walker<'a> {
    /// File name for errors.
    file: &'a str,
    /// The file's text, to recover plain scalars' spelling.
    text: &'a str,
    /// Every problem found so far.
    errors: Vec<ConfigError>,
    /// The domain name (possibly empty), the first element of every descriptor path.
    domain: String,
    /// Every limit name in the domain (targets of `replaces`).
    limit_names: HashSet<String>,
    /// Every `replaces` name not already rejected, checked against `limit_names` at the end.
    replaces_refs: Vec<(String, Pos)>,
    /// Some descriptor has `share_threshold: true`.
    shares_thresholds: bool,
    /// Some descriptor has `value_to_metric: true`.
    values_in_metrics: bool,
    /// `layers:` as declared; when given, every `layer:` must be one of them.
    layers: Option<Vec<String>>,
    /// With merging: the domains of earlier files, one of which this file may add to.
    merge: Option<Merge<'a>>,
    /// What this file adds to: the earlier files' domain of the same name, taken out of
    /// `merge` (its descriptors become this file's starting level).
    base: Option<Base<'a>>,
    /// `quota_buckets:`, the Rate Limit Quota Service's rules.
    quota: crate::rlqs::QuotaRules,
}

/// The part of an earlier domain a merged file does not walk into.
struct Base<'a> {
    /// Its files, for [`Domain::source`].
    source: String,
    /// Its `plans:`.
    plans: Option<PlanTable>,
    /// Where its top-level descriptors and plans were written.
    origins: Option<&'a Origins>,
    /// Its `quota_buckets:`, if it has any: they are given in one file.
    quota: Option<crate::rlqs::QuotaRules>,
}

impl Walker<'_> {
    /// Records an error.
    fn error(&mut self, pos: Pos, reason: String) {
        self.errors.push(error_at(self.file, pos, reason));
    }

    /// Describes a node for messages: a scalar by its spelling, a container by its kind.
    fn describe(&self, node: &YNode) -> String {
        match (&node.value, node.scalar_text(self.text)) {
            (Value::Str(text), _) => format!("the string '{text}'"),
            (_, Some(text)) => text,
            (Value::Null, None) => "nothing".to_owned(),
            (other, None) => other.kind().to_owned(),
        }
    }

    /// A mapping's entries, reporting every key not in `allowed`; `None` if it is no mapping.
    fn fields<'n>(
        &mut self,
        node: &'n YNode,
        what: &str,
        allowed: &'static [&'static str],
    ) -> Option<Fields<'n>> {
        let Value::Map(entries) = &node.value else {
            let found = self.describe(node);
            self.error(node.pos, format!("{what} must be a mapping, found {found}"));
            return None;
        };
        let mut fields = Fields {
            entries: Vec::with_capacity(entries.len()),
        };
        for (key, value) in entries {
            let name = match &key.value {
                Value::Seq(_) | Value::Map(_) | Value::Null => None,
                _ => key.scalar_text(self.text),
            };
            let Some(name) = name else {
                let found = self.describe(key);
                self.error(
                    key.pos,
                    format!("keys in {what} must be strings, found {found}"),
                );
                continue;
            };
            match allowed.iter().find(|known| **known == name) {
                Some(known) => fields.entries.push((*known, key, value)),
                None => self.error(
                    key.pos,
                    format!(
                        "unknown key '{name}' in {what} (valid keys: {})",
                        allowed.join(", ")
                    ),
                ),
            }
        }
        Some(fields)
    }

    /// A scalar as text (null is empty); `None` after reporting a list or mapping.
    fn text(&mut self, field: &str, node: &YNode) -> Option<String> {
        match &node.value {
            Value::Null => Some(String::new()),
            Value::Seq(_) | Value::Map(_) => {
                let found = node.value.kind();
                self.error(node.pos, format!("{field} must be a string, found {found}"));
                None
            }
            _ => node.scalar_text(self.text),
        }
    }

    /// A YAML boolean; `None` after reporting anything else.
    fn boolean(&mut self, field: &str, node: &YNode) -> Option<bool> {
        if let Value::Bool(value) = node.value {
            return Some(value);
        }
        let found = self.describe(node);
        self.error(
            node.pos,
            format!("{field} must be true or false, found {found}"),
        );
        None
    }

    /// An integer in `min..=u32::MAX`; `None` after reporting anything else.
    fn uint(&mut self, field: &str, node: &YNode, min: u32) -> Option<u32> {
        if let Value::Int(value) = node.value
            && let Ok(value) = u32::try_from(value)
            && value >= min
        {
            return Some(value);
        }
        let found = self.describe(node);
        self.error(
            node.pos,
            format!(
                "{field} must be an integer from {min} to {}, found {found}",
                u32::MAX
            ),
        );
        None
    }

    /// The whole file: its domain (name and key position), its top level and its plan table.
    fn file(&mut self, root: &YNode) -> (Option<(String, Pos)>, Level, Option<PlanTable>) {
        let mut level = Level::default();
        if matches!(root.value, Value::Null) {
            self.error(
                Pos::new(1, 1),
                "config file is empty: it needs 'domain' and 'descriptors'".to_owned(),
            );
            return (None, level, None);
        }
        let Some(fields) = self.fields(root, "config file", FILE_KEYS) else {
            return (None, level, None);
        };
        if let Some((_, layers)) = fields.get("layers") {
            self.layers = self.layer_list(layers);
        }
        let mut domain = None;
        match fields.raw("domain") {
            None => self.error(
                root.pos,
                "missing key 'domain': config file cannot have empty domain".to_owned(),
            ),
            Some((key, value)) => match self.text("domain", value) {
                Some(name) if name.is_empty() => {
                    self.error(key.pos, "config file cannot have empty domain".to_owned());
                }
                Some(name) => {
                    self.domain.clone_from(&name);
                    self.merge_into(&name, &mut level);
                    domain = Some((name, key.pos));
                }
                None => {}
            },
        }
        if let Some((_, descriptors)) = fields.get("descriptors") {
            let parent = self.domain.clone();
            self.descriptors(descriptors, &parent, None, &mut level);
        }
        let plans = fields.get("plans").and_then(|(key, plans)| {
            if let Some(base) = &self.base
                && base.plans.is_some()
            {
                let first = base
                    .origins
                    .and_then(|origins| origins.plans.as_deref())
                    .unwrap_or(base.source.as_str());
                let reason = format!(
                    "plans of domain '{}' are already given in {first}; give them in one file",
                    self.domain
                );
                self.error(key.pos, reason);
                return None;
            }
            self.plans(plans, &level)
        });
        if let Some((key, quota)) = fields.get("quota_buckets") {
            if let Some(base) = &self.base
                && base.quota.is_some()
            {
                let reason = format!(
                    "quota_buckets of domain '{}' are already given in {}; give them in one file",
                    self.domain, base.source
                );
                self.error(key.pos, reason);
            } else {
                // A lone `api_key` descriptor gains its plan, here as in requests.
                let table = plans
                    .clone()
                    .or_else(|| self.base.as_ref().and_then(|base| base.plans.clone()));
                self.quota = self.quota_buckets(quota, &level, table.as_ref());
            }
        }
        (domain, level, plans)
    }

    /// With merging, starts this file from the domain `name` of earlier files, if there is one.
    fn merge_into(&mut self, name: &str, level: &mut Level) {
        let Some(merge) = self.merge.as_mut() else {
            return;
        };
        let Some(earlier) = merge.domains.remove(name) else {
            return;
        };
        *level = earlier.root;
        limit_names(level, &mut self.limit_names);
        self.shares_thresholds |= earlier.shares_thresholds;
        self.values_in_metrics |= earlier.values_in_metrics;
        self.base = Some(Base {
            source: earlier.source,
            plans: earlier.plans,
            origins: merge.origins.get(name),
            quota: (!earlier.quota.rules.is_empty()).then_some(earlier.quota),
        });
    }

    /// `layers: [edge, plan, endpoint]`: distinct non-empty names.
    fn layer_list(&mut self, node: &YNode) -> Option<Vec<String>> {
        let Value::Seq(items) = &node.value else {
            let found = self.describe(node);
            self.error(node.pos, format!("layers must be a list, found {found}"));
            return None;
        };
        let mut names: Vec<String> = Vec::new();
        for item in items {
            match self.text("layer", item) {
                Some(name) if name.is_empty() => {
                    self.error(item.pos, "layer names must not be empty".to_owned());
                }
                Some(name) if names.contains(&name) => {
                    self.error(item.pos, format!("duplicate layer '{name}'"));
                }
                Some(name) => names.push(name),
                None => {}
            }
        }
        Some(names)
    }

    /// `plans:`: the API key -> plan table; every plan it names must have a descriptor.
    fn plans(&mut self, node: &YNode, root: &Level) -> Option<PlanTable> {
        let fields = self.fields(node, "plans", PLANS_KEYS)?;
        let required = |walker: &mut Self, name: &str| match fields.get(name) {
            Some((_, value)) => match walker.text(name, value) {
                Some(text) if text.is_empty() => {
                    walker.error(value.pos, format!("plans.{name} must not be empty"));
                    None
                }
                other => other.map(|text| (text, value.pos)),
            },
            None => {
                walker.error(node.pos, format!("plans is missing '{name}'"));
                None
            }
        };
        let from = required(self, "from");
        let entry = required(self, "entry");
        let default = required(self, "default");
        let mut keys = crate::config::model::Map::default();
        let mut named = Vec::new();
        if let Some((_, table)) = fields.get("keys") {
            match &table.value {
                Value::Map(entries) => {
                    for (key, plan) in entries {
                        let (Some(key_text), Some(plan_text)) =
                            (self.text("plans key", key), self.text("plan", plan))
                        else {
                            continue;
                        };
                        named.push((plan_text.clone(), plan.pos));
                        keys.insert(key_text, plan_text);
                    }
                }
                _ => {
                    let found = self.describe(table);
                    self.error(
                        table.pos,
                        format!("plans.keys must be a mapping, found {found}"),
                    );
                }
            }
        }
        let (Some((from, _)), Some((entry, _)), Some((default, default_pos))) =
            (from, entry, default)
        else {
            return None;
        };
        named.push((default.clone(), default_pos));
        for (plan, pos) in named {
            let described = root.keys.get(&entry).is_some_and(|nodes| {
                nodes.exact.contains_key(&plan)
                    || nodes.wildcards.iter().any(|(w, _)| w.matches(&plan))
                    || nodes.default.is_some()
            });
            if !described {
                self.error(
                    pos,
                    format!("plan '{plan}' has no top-level descriptor '{entry}: {plan}' to match"),
                );
            }
        }
        Some(PlanTable {
            from,
            entry,
            default,
            keys,
        })
    }

    /// A `descriptors:` list, each placed into `level`; `layer` is the parent's.
    fn descriptors(
        &mut self,
        node: &YNode,
        parent_path: &str,
        layer: Option<&str>,
        level: &mut Level,
    ) {
        match &node.value {
            Value::Seq(items) => {
                for item in items {
                    self.descriptor(item, parent_path, layer, level);
                }
            }
            _ => {
                let found = self.describe(node);
                self.error(
                    node.pos,
                    format!("descriptors must be a list, found {found}"),
                );
            }
        }
    }

    /// One descriptor, placed into `level` unless it is broken or a duplicate.
    fn descriptor(
        &mut self,
        item: &YNode,
        parent_path: &str,
        parent_layer: Option<&str>,
        level: &mut Level,
    ) {
        let Some(fields) = self.fields(item, "descriptor", DESCRIPTOR_KEYS) else {
            return;
        };
        let key = match fields.raw("key") {
            None => {
                self.error(
                    item.pos,
                    "descriptor has empty key (missing 'key')".to_owned(),
                );
                None
            }
            Some((key_node, value)) => match self.text("key", value) {
                Some(key) if key.is_empty() => {
                    self.error(key_node.pos, "descriptor has empty key".to_owned());
                    None
                }
                other => other.map(|key| (key, value.pos)),
            },
        };
        let value = fields
            .get("value")
            .and_then(|(_, value)| Some((self.text("value", value)?, value.pos)))
            .filter(|(value, _)| !value.is_empty());
        let key_text = key.as_ref().map_or("", |(key, _)| key.as_str());
        let path = match &value {
            Some((value, _)) => format!("{parent_path}.{key_text}_{value}"),
            None => format!("{parent_path}.{key_text}"),
        };
        let layer = match fields.get("layer") {
            Some((_, layer)) => self
                .layer(layer)
                .or_else(|| parent_layer.map(str::to_owned)),
            None => parent_layer.map(str::to_owned),
        };
        let mut node = Node {
            path,
            layer,
            ..Node::default()
        };
        if let Some((_, flag)) = fields.get("detailed_metric") {
            node.detailed_metric = self.boolean("detailed_metric", flag).unwrap_or(false);
        }
        if let Some((_, flag)) = fields.get("value_to_metric") {
            node.value_to_metric = self.boolean("value_to_metric", flag).unwrap_or(false);
            self.values_in_metrics |= node.value_to_metric;
        }
        if let Some((flag_key, flag)) = fields.get("share_threshold")
            && self.boolean("share_threshold", flag) == Some(true)
        {
            match &value {
                Some((value, _)) if value.contains('*') => {
                    node.shared_value = Some(value.clone());
                    self.shares_thresholds = true;
                }
                _ => self.error(
                    flag_key.pos,
                    format!(
                        "share_threshold can only be used with wildcard values (containing '*'), \
                         but found key '{}'",
                        node.path
                    ),
                ),
            }
        }
        let shadow = fields
            .get("shadow_mode")
            .and_then(|(_, flag)| self.boolean("shadow_mode", flag))
            .unwrap_or(false);
        let quota_mode = fields
            .get("quota_mode")
            .and_then(|(_, flag)| self.boolean("quota_mode", flag))
            .unwrap_or(false);
        node.policy = self.policy(&fields, shadow, quota_mode);
        if let Some((_, metadata)) = fields.get("metadata") {
            node.metadata = self.metadata(metadata);
        }
        if let Some((_, children)) = fields.get("descriptors") {
            let path = node.path.clone();
            let layer = node.layer.clone();
            self.descriptors(children, &path, layer.as_deref(), &mut node.children);
        }
        let Some((key, key_pos)) = key else {
            return;
        };
        let nodes = level.keys.entry(key).or_default();
        let duplicate_at = match value {
            None if nodes.default.is_some() => key_pos,
            None => {
                nodes.default = Some(Box::new(node));
                return;
            }
            Some((value, value_pos)) => match Wildcard::new(&value) {
                Some(_) if nodes.wildcards.iter().any(|(w, _)| w.pattern == value) => value_pos,
                Some(wildcard) => {
                    nodes.wildcards.push((wildcard, node));
                    return;
                }
                None if nodes.exact.contains_key(&value) => value_pos,
                None => {
                    nodes.exact.insert(value, node);
                    return;
                }
            },
        };
        let earlier = self
            .base
            .as_ref()
            .and_then(|base| base.origins?.descriptors.get(&node.path));
        let reason = match earlier {
            Some(file) => format!(
                "duplicate descriptor composite key '{}' (already defined in {file})",
                node.path
            ),
            None => format!("duplicate descriptor composite key '{}'", node.path),
        };
        self.error(duplicate_at, reason);
    }

    /// A `layer:` name; one of `layers:` when those are declared.
    fn layer(&mut self, node: &YNode) -> Option<String> {
        let name = self.text("layer", node)?;
        if name.is_empty() {
            self.error(node.pos, "layer must not be empty".to_owned());
            return None;
        }
        if let Some(declared) = &self.layers
            && !declared.contains(&name)
        {
            let declared = declared.join(", ");
            self.error(
                node.pos,
                format!("unknown layer '{name}' (declared layers: {declared})"),
            );
            return None;
        }
        Some(name)
    }

    /// A `metadata:` mapping as a protobuf Struct; `None` after reporting anything else.
    /// envoyproxy/ratelimit reads it as Go's `map[string]interface{}`: its own keys are their
    /// spelling (`y`, `on`, `010`), the keys of mappings inside it Go's `%v` of their value
    /// (`true`, `8`), and values keep their YAML 1.1 type (`off` is false, `010` is 8).
    fn metadata(&mut self, node: &YNode) -> Option<prost_types::Struct> {
        let Value::Map(entries) = &node.value else {
            let found = self.describe(node);
            self.error(
                node.pos,
                format!("metadata must be a mapping, found {found}"),
            );
            return None;
        };
        let mut fields = std::collections::BTreeMap::new();
        for (key, value) in entries {
            let name = match &key.value {
                Value::Null => Some(String::new()),
                _ => key.scalar_text(self.text),
            };
            let Some(name) = name else {
                let found = self.describe(key);
                self.error(
                    key.pos,
                    format!("metadata keys must be scalars, found {found}"),
                );
                return None;
            };
            fields.insert(name, self.struct_value(value)?);
        }
        Some(prost_types::Struct { fields })
    }

    fn struct_value(&mut self, node: &YNode) -> Option<prost_types::Value> {
        use prost_types::value::Kind;
        let kind = match &node.value {
            Value::Null => Kind::NullValue(0),
            Value::Bool(value) => Kind::BoolValue(*value),
            // Struct numbers are doubles, as in JSON.
            Value::Int(value) => Kind::NumberValue(*value as f64),
            Value::Float(value) => Kind::NumberValue(*value),
            Value::Str(value) => Kind::StringValue(value.clone()),
            Value::Seq(items) => Kind::ListValue(prost_types::ListValue {
                values: items
                    .iter()
                    .map(|item| self.struct_value(item))
                    .collect::<Option<_>>()?,
            }),
            Value::Map(entries) => {
                let mut fields = std::collections::BTreeMap::new();
                for (key, value) in entries {
                    let Some(name) = yaml::go_format(&key.value) else {
                        let found = self.describe(key);
                        self.error(
                            key.pos,
                            format!("metadata keys must be scalars, found {found}"),
                        );
                        return None;
                    };
                    fields.insert(name, self.struct_value(value)?);
                }
                Kind::StructValue(prost_types::Struct { fields })
            }
        };
        Some(prost_types::Value { kind: Some(kind) })
    }

    /// A descriptor's `rate_limit` / `rate_limits`; `None` if it has none or they are broken.
    fn policy(
        &mut self,
        fields: &Fields<'_>,
        descriptor_shadow: bool,
        quota_mode: bool,
    ) -> Option<Policy> {
        let single = fields.get("rate_limit");
        let list = fields.get("rate_limits");
        let mut broken = false;
        let mut parsed = Vec::new();
        if let Some((key, node)) = single {
            match self.limit(node, key.pos, "rate_limit") {
                Some(limit) => parsed.push(limit),
                None => broken = true,
            }
        }
        if let Some((key, node)) = list {
            if single.is_some() {
                self.error(
                    key.pos,
                    "rate_limit and rate_limits cannot both be given; put every limit in rate_limits"
                        .to_owned(),
                );
                broken = true;
            }
            match &node.value {
                Value::Seq(items) if items.is_empty() => {
                    self.error(node.pos, "rate_limits must not be an empty list".to_owned());
                    broken = true;
                }
                Value::Seq(items) => {
                    for item in items {
                        match self.limit(item, item.pos, "rate_limits entry") {
                            Some(limit) => parsed.push(limit),
                            None => broken = true,
                        }
                    }
                }
                _ => {
                    let found = self.describe(node);
                    self.error(
                        node.pos,
                        format!("rate_limits must be a list, found {found}"),
                    );
                    broken = true;
                }
            }
        }
        if parsed.len() > 1 {
            for limit in parsed.iter().filter(|limit| limit.limit.is_none()) {
                self.error(
                    limit.pos,
                    "an unlimited limit cannot be combined with other limits on one descriptor"
                        .to_owned(),
                );
                broken = true;
            }
        }
        let names: HashSet<String> = parsed.iter().filter_map(|l| l.name.clone()).collect();
        for limit in &mut parsed {
            for (target, pos) in std::mem::take(&mut limit.replaces) {
                if names.contains(&target) {
                    self.error(
                        pos,
                        format!("replaces should not contain name of same descriptor ('{target}')"),
                    );
                    broken = true;
                } else {
                    limit.replaces.push((target, pos));
                }
            }
        }
        let unlimited_replaces: Vec<String> = parsed
            .iter()
            .filter(|limit| limit.limit.is_none())
            .flat_map(|limit| limit.replaces.iter().map(|(name, _)| name.clone()))
            .collect();
        for limit in &mut parsed {
            self.replaces_refs.append(&mut limit.replaces);
        }
        self.limit_names.extend(names);
        if broken || parsed.is_empty() {
            return None;
        }
        if let [
            ParsedLimit {
                limit: None, name, ..
            },
        ] = parsed.as_mut_slice()
        {
            return Some(Policy::Unlimited {
                name: name.take(),
                replaces: unlimited_replaces,
            });
        }

        let mut limits: Vec<Limit> = Vec::with_capacity(parsed.len());
        for mut limit in parsed.into_iter().filter_map(|parsed| parsed.limit) {
            limit.shadow |= descriptor_shadow;
            limit.quota_mode = quota_mode;
            // Limits of one descriptor sharing algorithm and period (a shadow trial of a
            // stricter limit, say) each need their own counter.
            limit.variant = limits
                .iter()
                .filter(|other| other.algorithm == limit.algorithm && other.period == limit.period)
                .count() as u32;
            limits.push(limit);
        }
        Some(Policy::Limits(limits))
    }

    /// One rate limit mapping; `at` is where to report missing keys. `None` if it is broken.
    fn limit(&mut self, node: &YNode, at: Pos, what: &str) -> Option<ParsedLimit> {
        let fields = self.fields(node, what, LIMIT_KEYS)?;
        let mut ok = true;
        // `None` when `unlimited` itself is broken: then missing keys are not reported, as
        // they might not have been meant to be there.
        let unlimited = match fields.get("unlimited") {
            Some((_, flag)) => self.boolean("unlimited", flag),
            None => Some(false),
        };
        ok &= unlimited.is_some();
        let name = match fields.get("name") {
            Some((_, name)) => self.text("name", name).or_else(|| {
                ok = false;
                None
            }),
            None => None,
        }
        .filter(|name| !name.is_empty());
        let replaces = match fields.get("replaces") {
            Some((_, list)) => self.replaces(list).unwrap_or_else(|| {
                ok = false;
                Vec::new()
            }),
            None => Vec::new(),
        };
        if unlimited == Some(true) {
            ok &= self.nothing_limited_only(&fields);
            return ok.then_some(ParsedLimit {
                limit: None,
                name,
                replaces,
                pos: at,
            });
        }
        let unit = match fields.get("unit") {
            None => {
                if unlimited.is_some() {
                    self.error(at, format!("{what} is missing 'unit'"));
                }
                None
            }
            Some((_, unit)) => self.unit(unit),
        };
        let requests_per_unit = match fields.get("requests_per_unit") {
            None => {
                if unlimited.is_some() {
                    self.error(at, format!("{what} is missing 'requests_per_unit'"));
                }
                None
            }
            Some((_, count)) => self.uint("requests_per_unit", count, 0),
        };
        let algorithm = match fields.get("algorithm") {
            None => Some(Algorithm::FixedWindow),
            Some((_, algorithm)) => self.algorithm(algorithm),
        };
        let burst = match fields.get("burst") {
            None => Some(None),
            Some((key, burst)) => {
                let value = self.uint("burst", burst, 1).and_then(NonZeroU32::new);
                if let Some(algorithm) = algorithm
                    && !algorithm.takes_burst()
                {
                    let valid: Vec<&str> = Algorithm::ALL
                        .iter()
                        .filter(|a| a.takes_burst())
                        .map(|a| a.name())
                        .collect();
                    self.error(
                        key.pos,
                        format!("burst is only for {}, not {algorithm}", valid.join(" and ")),
                    );
                    ok = false;
                }
                value.map(Some)
            }
        };
        let multiplier = match fields.get("unit_multiplier") {
            None => Some(NonZeroU32::MIN),
            Some((_, multiplier)) => self
                .uint("unit_multiplier", multiplier, 1)
                .and_then(NonZeroU32::new),
        };
        let shadow = match fields.get("shadow_mode") {
            None => Some(false),
            Some((_, flag)) => self.boolean("shadow_mode", flag),
        };
        let charge = match fields.get("charge") {
            None => Some(Charge::default()),
            Some((_, value)) => self.charge(value),
        };
        let (
            true,
            Some(unit),
            Some(requests_per_unit),
            Some(algorithm),
            Some(burst),
            Some(multiplier),
            Some(shadow),
            Some(charge),
        ) = (
            ok,
            unit,
            requests_per_unit,
            algorithm,
            burst,
            multiplier,
            shadow,
            charge,
        )
        else {
            return None;
        };
        let period = Period { unit, multiplier };
        if let Some(reason) = magnitude_problem(algorithm, requests_per_unit, burst, period) {
            self.error(at, reason);
            return None;
        }
        Some(ParsedLimit {
            limit: Some(Limit {
                name: name.clone(),
                requests_per_unit,
                period: Period { unit, multiplier },
                algorithm,
                burst,
                shadow,
                replaces: replaces.iter().map(|(name, _)| name.clone()).collect(),
                quota_mode: false,
                variant: 0,
                charge,
            }),
            name,
            replaces,
            pos: at,
        })
    }

    /// Reports every key of an `unlimited: true` limit that only a real limit can have; whether
    /// there was none.
    fn nothing_limited_only(&mut self, fields: &Fields<'_>) -> bool {
        let mut none = true;
        for key in LIMITED_ONLY_KEYS {
            if let Some((key_node, value)) = fields.get(key) {
                // envoyproxy/ratelimit reads an empty or UNKNOWN unit as no unit, and tools
                // that write its files from structs emit `unit: ""`. Anything else that is no
                // unit is reported as such, not as a unit given.
                if *key == "unit" {
                    let unit = match &value.value {
                        Value::Str(unit) => Some(unit.as_str()),
                        _ => None,
                    };
                    if unit
                        .is_some_and(|unit| unit.is_empty() || unit.eq_ignore_ascii_case("unknown"))
                    {
                        continue;
                    }
                    if unit.and_then(Unit::parse).is_none() {
                        self.unit(value);
                        none = false;
                        continue;
                    }
                }
                let reason = match *key {
                    "unit" => "should not specify rate limit unit when unlimited".to_owned(),
                    other => format!("should not specify {other} when unlimited"),
                };
                self.error(key_node.pos, reason);
                none = false;
            }
        }
        none
    }

    /// A `unit:` value, case-insensitive; `None` after reporting anything else.
    fn unit(&mut self, node: &YNode) -> Option<Unit> {
        if let Value::Str(text) = &node.value
            && let Some(unit) = Unit::parse(text)
        {
            return Some(unit);
        }
        let spelled = node
            .scalar_text(self.text)
            .unwrap_or_else(|| self.describe(node));
        let valid: Vec<&str> = Unit::ALL.iter().map(|unit| unit.name()).collect();
        self.error(
            node.pos,
            format!(
                "invalid rate limit unit '{spelled}' (valid: {})",
                valid.join(", ")
            ),
        );
        None
    }

    /// An `algorithm:` value, case-insensitive; `None` after reporting anything else.
    fn algorithm(&mut self, node: &YNode) -> Option<Algorithm> {
        if let Value::Str(text) = &node.value
            && let Some(algorithm) = Algorithm::parse(&text.to_ascii_lowercase())
        {
            return Some(algorithm);
        }
        let spelled = node
            .scalar_text(self.text)
            .unwrap_or_else(|| self.describe(node));
        let valid: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
        self.error(
            node.pos,
            format!(
                "invalid algorithm '{spelled}' (valid: {})",
                valid.join(", ")
            ),
        );
        None
    }

    /// A limit's `charge:` policy.
    fn charge(&mut self, node: &YNode) -> Option<Charge> {
        if let Value::Str(text) = &node.value
            && let Some(charge) = Charge::parse(text)
        {
            return Some(charge);
        }
        let spelled = node
            .scalar_text(self.text)
            .unwrap_or_else(|| self.describe(node));
        self.error(
            node.pos,
            format!("invalid charge '{spelled}' (valid: descriptor_hits, always, never)"),
        );
        None
    }

    /// A `replaces:` list of `{name: <limit>}`; `None` if any entry is broken.
    fn replaces(&mut self, node: &YNode) -> Option<Vec<(String, Pos)>> {
        let Value::Seq(items) = &node.value else {
            let found = self.describe(node);
            self.error(node.pos, format!("replaces must be a list, found {found}"));
            return None;
        };
        let mut names = Vec::with_capacity(items.len());
        let mut ok = true;
        for item in items {
            let Some(fields) = self.fields(item, "replaces entry", REPLACES_KEYS) else {
                ok = false;
                continue;
            };
            let name = match fields.get("name") {
                Some((_, name)) => self.text("name", name).map(|text| (text, name.pos)),
                None => Some((String::new(), item.pos)),
            };
            match name {
                Some((name, _)) if name.is_empty() => {
                    self.error(
                        item.pos,
                        "should not have an empty replaces entry".to_owned(),
                    );
                    ok = false;
                }
                Some(name) => names.push(name),
                None => ok = false,
            }
        }
        ok.then_some(names)
    }

    /// Reports every `replaces` name that no limit of the domain has.
    /// When merging, the names not found yet are returned instead: a later file of the
    /// domain may give them.
    fn check_replaces(&mut self) -> Vec<(String, Pos)> {
        let mut unknown = Vec::new();
        for (name, pos) in std::mem::take(&mut self.replaces_refs) {
            if self.limit_names.contains(&name) {
                continue;
            }
            if self.merge.is_some() {
                unknown.push((name, pos));
            } else {
                let reason = unknown_replaces(&name, &self.domain);
                self.error(pos, reason);
            }
        }
        unknown
    }
}
