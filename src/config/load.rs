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

/// Loads a config file, or every `*.yaml` / `*.yml` file at the top level of a directory.
///
/// In a directory, names starting with `.` are skipped (Kubernetes `ConfigMap` mounts keep their
/// real files under `..data`), symlinks are followed, and files are read in name order. Every
/// file is checked even when an earlier one has errors.
///
/// # Errors
/// Every problem of every file, each with its file, line and column, in file order.
pub fn load_path(path: &Path) -> Result<Config, ConfigErrors> {
    let files = config_files(path).map_err(|error| ConfigErrors(vec![error]))?;
    load_sources(files.into_iter().map(|file| {
        let name = file.display().to_string();
        // Invalid UTF-8 is an `InvalidData` read error, reported like any other.
        let text = fs::read_to_string(&file).map_err(|error| unreadable(&file, &error));
        (name, text)
    }))
}

/// Loads named texts (files, or resources pushed over xDS) into one config, one domain each,
/// exactly as [`load_path`] checks files: every source is checked even after an error.
///
/// # Errors
/// Every problem of every source, each named by its source, in source order.
pub fn load_sources(
    sources: impl IntoIterator<Item = (String, Result<String, ConfigError>)>,
) -> Result<Config, ConfigErrors> {
    let mut errors = Vec::new();
    let mut config = Config::default();
    let mut first_file: HashMap<String, String> = HashMap::new();
    for (name, text) in sources {
        let text = match text {
            Ok(text) => text,
            Err(error) => {
                errors.push(error);
                continue;
            }
        };
        let loaded = load_file(&name, &text);
        let mut file_errors = Vec::new();
        let mut duplicate = false;
        if let Some((domain, pos)) = &loaded.domain {
            if let Some(first) = first_file.get(domain) {
                duplicate = true;
                file_errors.push(error_at(
                    &name,
                    *pos,
                    format!(
                        "duplicate domain '{domain}' in config file (already defined in {first})"
                    ),
                ));
            } else {
                first_file.insert(domain.clone(), name.clone());
            }
        }
        match loaded.result {
            Ok(domain) if !duplicate => {
                config.domains.insert(domain.name.clone(), domain);
            }
            Ok(_) => {}
            Err(more) => file_errors.extend(more),
        }
        file_errors.sort_by_key(|error| (error.line, error.column));
        errors.append(&mut file_errors);
    }
    if errors.is_empty() {
        Ok(config)
    } else {
        Err(ConfigErrors(errors))
    }
}

/// Loads one file's text; `file_name` is only used in errors and as [`Domain::source`].
///
/// # Errors
/// Every problem of the file, sorted by line and column.
pub fn load_str(file_name: &str, yaml: &str) -> Result<Domain, Vec<ConfigError>> {
    load_file(file_name, yaml).result
}

/// The files [`load_path`] reads for `path`: the file itself, or a directory's config files.
///
/// # Errors
/// When the path or the directory cannot be read.
pub fn config_files(path: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    match fs::metadata(path) {
        Ok(meta) if meta.is_dir() => list_dir(path),
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
        reason: "no config file (*.yaml or *.yml with a 'domain:'): every request would be \
                 answered OK; to run without limits on purpose, load a file of only \
                 'domain: <name>'"
            .to_owned(),
    })
}

/// Warns about entries of the directory `path` that are not read (visible files without a
/// `.yaml` or `.yml` name, and subdirectories), which make a loaded config limit less than its
/// author may think.
pub fn warn_about_unread(path: &Path) {
    let unread = unread_files(path);
    if !unread.is_empty() {
        // Entry names alone: the directory is the `path` field.
        let names: Vec<String> = unread
            .iter()
            .map(|entry| {
                let name = entry
                    .file_name()
                    .unwrap_or(entry.as_os_str())
                    .to_string_lossy();
                if entry.is_dir() {
                    format!("{name}/")
                } else {
                    name.into_owned()
                }
            })
            .collect();
        tracing::warn!(
            path = %path.display(),
            "not read, as only *.yaml and *.yml files at the top level are config files: {}",
            names.join(", ")
        );
    }
}

/// The visible entries of the directory `path` that [`load_path`] does not read (files without
/// a config name, and subdirectories); none when `path` is a file or cannot be listed.
pub fn unread_files(path: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(path) else {
        return Vec::new();
    };
    let mut unread: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|entry| !entry.file_name().to_string_lossy().starts_with('.'))
        .map(|entry| entry.path())
        .filter(|path| match fs::metadata(path) {
            Ok(meta) if meta.is_dir() => true,
            Ok(meta) => meta.is_file() && !is_config_name(&path.to_string_lossy()),
            Err(_) => false,
        })
        .collect();
    unread.sort();
    unread
}

fn is_config_name(name: &str) -> bool {
    name.ends_with(".yaml") || name.ends_with(".yml")
}

/// The config files of a directory, sorted by name.
fn list_dir(dir: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let entries = fs::read_dir(dir).map_err(|error| unreadable(dir, &error))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|error| unreadable(dir, &error))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || !is_config_name(&name) {
            continue;
        }
        let path = entry.path();
        // A broken symlink with a config name is kept, so reading it reports the problem.
        if fs::metadata(&path).map_or(true, |meta| meta.is_file()) {
            files.push(path);
        }
    }
    files.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    Ok(files)
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
}

/// Stack for parsing and walking a file: both recurse once per nesting level (serde-saphyr stops
/// at 64), which overflows a 2 MiB thread stack in debug builds long before that.
const LOAD_STACK_BYTES: usize = 64 * 1024 * 1024;

/// Parses and validates one file, on a thread with a stack deep enough for any nesting the
/// parser accepts, so a deeply nested file is an error and never a crash.
fn load_file(file: &str, text: &str) -> Loaded {
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("rlsd-config".to_owned())
            .stack_size(LOAD_STACK_BYTES)
            .spawn_scoped(scope, || load_file_here(file, text))
            .ok()
            .and_then(|loading| loading.join().ok())
    })
    // Without a thread (none could be spawned, or it panicked), load here.
    .unwrap_or_else(|| load_file_here(file, text))
}

fn load_file_here(file: &str, text: &str) -> Loaded {
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
        quota: Default::default(),
    };
    let (domain, root, plans) = walker.file(&root);
    walker.check_replaces();
    let mut errors = std::mem::take(&mut walker.errors);
    let result = match (&domain, errors.is_empty()) {
        (Some((name, _)), true) => Ok(Domain {
            name: name.clone(),
            source: file.to_owned(),
            root,
            plans,
            shares_thresholds: walker.shares_thresholds,
            values_in_metrics: walker.values_in_metrics,
            quota: std::mem::take(&mut walker.quota),
        }),
        _ => {
            errors.sort_by_key(|error| (error.line, error.column));
            Err(errors)
        }
    };
    Loaded { domain, result }
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
    /// `quota_buckets:`, the Rate Limit Quota Service's rules.
    quota: crate::rlqs::QuotaRules,
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
                    domain = Some((name, key.pos));
                }
                None => {}
            },
        }
        if let Some((_, descriptors)) = fields.get("descriptors") {
            let parent = self.domain.clone();
            self.descriptors(descriptors, &parent, None, &mut level);
        }
        if let Some((_, quota)) = fields.get("quota_buckets") {
            self.quota = self.quota_buckets(quota);
        }
        let plans = fields
            .get("plans")
            .and_then(|(_, plans)| self.plans(plans, &level));
        (domain, level, plans)
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
        self.error(
            duplicate_at,
            format!("duplicate descriptor composite key '{}'", node.path),
        );
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

    /// A descriptor's `rate_limit` / `rate_limits`; `None` if it has none or they are broken.
    /// A `metadata:` mapping as a protobuf Struct; `None` after reporting anything else.
    fn metadata(&mut self, node: &YNode) -> Option<prost_types::Struct> {
        if !matches!(node.value, Value::Map(_)) {
            let found = self.describe(node);
            self.error(
                node.pos,
                format!("metadata must be a mapping, found {found}"),
            );
            return None;
        }
        match self.struct_value(node)?.kind {
            Some(prost_types::value::Kind::StructValue(fields)) => Some(fields),
            _ => None,
        }
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
                    let Value::Str(name) = &key.value else {
                        let found = self.describe(key);
                        self.error(
                            key.pos,
                            format!("metadata keys must be strings, found {found}"),
                        );
                        return None;
                    };
                    fields.insert(name.clone(), self.struct_value(value)?);
                }
                Kind::StructValue(prost_types::Struct { fields })
            }
        };
        Some(prost_types::Value { kind: Some(kind) })
    }

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
    fn check_replaces(&mut self) {
        for (name, pos) in std::mem::take(&mut self.replaces_refs) {
            if !self.limit_names.contains(&name) {
                let reason = format!(
                    "replaces unknown limit name '{name}' (no limit in domain '{}' has that name)",
                    self.domain
                );
                self.error(pos, reason);
            }
        }
    }
}
