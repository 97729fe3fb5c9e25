//! Configuration: YAML files compatible with envoyproxy/ratelimit, validated into [`model`] types.

mod load;
pub mod model;
#[cfg(test)]
mod tests;
mod yaml;

pub use load::{
    ConfigError, ConfigErrors, LoadOptions, config_files, empty_config_error, load_path,
    load_sources, load_str, unread_files, warn_about_unread,
};
pub use model::{Config, Domain, KeyNodes, Level, Node, PlanTable, Policy, Wildcard};
