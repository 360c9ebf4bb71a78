# Cross-compiling spinquant-run for 64-bit ARM Linux with Debian's g++-aarch64-linux-gnu (build.sh
# --target aarch64 passes this file). Libraries come from absolute paths (the aarch64 executorch wheel,
# Debian's multiarch /usr/lib/aarch64-linux-gnu), so no CMAKE_FIND_ROOT_PATH: re-rooting those paths
# would hide them.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# pkg-config must describe arm64 PCRE2, not the host's
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")
