# Sourced on a machine without pip access (the GPU machine): makes `import pagedserve` work from a
# checkout without installing it, and installs the wheels carried in .whl/ (packages the image lacks).
#   source scripts/device-env.sh [CHECKOUT]      (default: the current directory)
# The copy mirrors the wheel's layout: src/pagedserve plus the four root folders as sub-packages.
_checkout=$(cd "${1:-.}" && pwd)
_site=${PAGEDSERVE_SITE_DIR:-/tmp/pagedserve-site}  # another folder keeps concurrent runs apart
rm -rf "$_site/pagedserve" && mkdir -p "$_site"
cp -r "$_checkout/src/pagedserve" "$_site/pagedserve"
for _d in protos scheduler executor kernels; do cp -r "$_checkout/$_d" "$_site/pagedserve/$_d"; done
if compgen -G "$_checkout/.whl/*.whl" > /dev/null || compgen -G ".whl/*.whl" > /dev/null; then
  _whl=$(compgen -G "$_checkout/.whl/*.whl" > /dev/null && echo "$_checkout/.whl" || echo ".whl")
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$_whl"/*.whl
fi
export PYTHONPATH="$_site:/tmp/site:$_checkout${PYTHONPATH:+:$PYTHONPATH}"  # the checkout: benchmarks/, scripts/
export PYTHONUNBUFFERED=1
