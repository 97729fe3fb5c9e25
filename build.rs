//! Compiles our trimmed Envoy protos with a vendored protoc, so a build needs nothing but Rust.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let well_known = protoc_bin_vendored::include_path()?;
    let prost_config = || {
        let mut config = tonic_prost_build::Config::new();
        config.protoc_executable(protoc.clone());
        config
    };
    println!("cargo:rerun-if-changed=proto");
    // The deploy checks ask cargo for packages of this platform only: resolving every platform
    // needs manifests a build never downloads, so a fresh cargo home would fail them.
    println!(
        "cargo:rustc-env=RLSD_BUILD_TARGET={}",
        std::env::var("TARGET")?
    );
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        // For gRPC reflection (grpcurl and friends); prost includes the imported files.
        .file_descriptor_set_path(out_dir.join("rls_descriptor.bin"))
        .build_client(true)
        .build_server(true)
        // prost's codec, with the response written by hand (src/codec.rs).
        .codec_path("crate::codec::RlsCodec")
        .compile_with_config(
            prost_config(),
            &[std::path::PathBuf::from(
                "proto/envoy/service/ratelimit/v3/rls.proto",
            )],
            &[std::path::PathBuf::from("proto"), well_known.clone()],
        )?;
    // Envoy's Rate Limit Quota Service, with prost's own codec: one report per Envoy every few
    // seconds. Compiled last: its `envoy.type.v3` file is a superset of the one above.
    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("rlqs_descriptor.bin"))
        .build_client(true)
        .build_server(true)
        .compile_with_config(
            prost_config(),
            &[std::path::PathBuf::from(
                "proto/envoy/service/rate_limit_quota/v3/rlqs.proto",
            )],
            &[std::path::PathBuf::from("proto"), well_known.clone()],
        )?;
    // The xDS client's protos, with prost's own codec: these messages are not on the hot path.
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_with_config(
            prost_config(),
            &[
                std::path::PathBuf::from("proto/envoy/service/discovery/v3/discovery.proto"),
                std::path::PathBuf::from("proto/ratelimit/config/ratelimit/v3/rls_conf.proto"),
            ],
            &[std::path::PathBuf::from("proto"), well_known],
        )?;
    Ok(())
}
