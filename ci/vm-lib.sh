# Shared by the VM runners: which kernel to boot and how to bring up SoftRoCE inside.

# The newest installed Debian kernel that ships rdma_rxe.
vm_kernel() {
  local k v
  for k in $(ls /boot/vmlinuz-* 2>/dev/null | sort -V -r); do
    v=${k#/boot/vmlinuz-}
    if find "/lib/modules/$v" -name 'rdma_rxe.ko*' 2>/dev/null | grep -q .; then
      echo "$k"; return 0
    fi
  done
  echo "no kernel with rdma_rxe under /boot: apt-get install linux-image-amd64 (or run scripts/setup)" >&2
  return 1
}

# Guest commands: load rdma_rxe and create rxe0 on a netdev ($1, default a dummy with $2/24).
vm_rxe_setup_script() {
  local netdev=${1:-dummy0} addr=${2:-192.0.2.1}
  cat <<SETUP
set -u
modprobe rdma_rxe || { echo "[vm] modprobe rdma_rxe failed"; }
if [ "$netdev" = dummy0 ]; then ip link add dummy0 type dummy; fi
ip addr add $addr/24 dev $netdev
ip link set $netdev up
ip link set lo up
rdma link add rxe0 type rxe netdev $netdev || echo "[vm] rdma link add failed"
ulimit -l unlimited
echo "[vm] \$(ibv_devices 2>&1 | tail -n +3 | awk '{print \$1}' | xargs) up on $netdev ($addr)"
SETUP
}
