# Sourced by tools/ray_wheels.sh and tools/trl_wheels.sh (bash).
# download_wheels OUT PACKAGE...: a fresh OUT/wheels with one wheel a package (Python 3.12, manylinux, no
# dependencies resolved: the list is the whole set), OUT kept out of git; fails unless every package came.
download_wheels() {
    local out=$1; shift
    local exclude
    rm -rf "$out" && mkdir -p "$out/wheels"
    exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
    grep -qxF "/$out/" "$exclude" 2>/dev/null || echo "/$out/" >> "$exclude"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d "$out/wheels" "$@" \
      2>&1 | grep -v 'is ignored: it is neither a file nor a directory' || true
    test "$(ls "$out/wheels"/*.whl 2>/dev/null | wc -l)" -eq $# || { echo "expected $# wheels in $out/wheels: the download failed"; exit 1; }
}

# pack_parts OUT TAR WHAT [CHECK]: tar OUT/wheels/*.whl, split the tar into OUT/pNN/part of 57 MiB (each travels in
# its own `run` call beside the tree, 64 MiB in all) and write OUT/<last part>/install.sh, which on the GPU machine
# checks TAR (the parts appended in order) by size and sha256, installs the wheels into /tmp/site with --no-deps, runs
# CHECK (a shell command; none by default) and says WHAT is installed. OUT/wheels and the whole tar are removed.
pack_parts() {
    local out=$1 tar=$2 what=$3 check=${4:-}
    local unpacked=${tar%.tar}w size sum last
    (cd "$out/wheels" && tar -cf ../all.tar ./*.whl)
    (cd "$out" && split -b 57M -d all.tar part_ && for f in part_*; do d=p${f#part_}; mkdir -p "$d"; mv "$f" "$d/part"; done)
    size=$(stat -c %s "$out/all.tar"); sum=$(sha256sum "$out/all.tar" | cut -d' ' -f1)
    last=$(ls "$out" | grep '^p[0-9]' | tail -1)
    cat > "$out/$last/install.sh" <<INNER
set -e
test \$(stat -c %s $tar) -eq $size || { echo "$(basename "$tar") is incomplete: send every part of $out in order"; exit 1; }
echo "$sum  $tar" | sha256sum -c - >/dev/null
rm -rf $unpacked && mkdir -p $unpacked && tar -xf $tar -C $unpacked
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $unpacked/*.whl 2>&1 | grep -v -i warning || true
${check}
echo "$what installed in /tmp/site"
INNER
    rm -rf "$out/wheels" "$out/all.tar"
    du -sh "$out"/p*
}
