# Sourced by start and stop: where a cluster's files live inside its state directory, and
# how to find its daemons.
# Everything the cluster writes is under $state: configs, keys, sockets, databases, logs, PIDs.
state=$(realpath -m "$1")
etc=$state/etc                   # slurm.conf, slurmdbd.conf (0600), env
munge_key_dir=$state/munge/key   # munged wants its key dir 0700 ...
munge_run_dir=$state/munge/run   # ... and its socket dir 0755, apart from each other
munge_socket=$munge_run_dir/munge.socket
mysql_dir=$state/mysql
mysql_socket=$mysql_dir/run/mysqld.sock
slurm_dir=$state/slurm
run_dir=$state/pids              # a PID file per daemon: mariadbd, munged, slurmdbd, slurmctld, slurmd-n1, ...
log_dir=$state/log
marker=$state/.gpunb-slurm      # says the directory holds a cluster's state (start wipes it)
partition=debug
nodes=(n1 n2)
export SLURM_CONF=$etc/slurm.conf

say() { echo "slurm: $*" >&2; }

# running PID: the process exists and is not a zombie (PID 1 may be slow to reap daemons).
running() {
    local process_state
    process_state=$(awk '/^State:/ {print $2}' "/proc/$1/status" 2>/dev/null)
    [ -n "$process_state" ] && [ "$process_state" != Z ]
}

# pid_of NAME: the PID of the running daemon whose PID file is pids/NAME.pid (slurmd-n1 is a
# slurmd), or failure; a PID file naming another process (a reused PID) does not count.
pid_of() {
    local pid
    pid=$(cat "$run_dir/$1.pid" 2>/dev/null) || return 1
    [ -n "$pid" ] && running "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "${1%%-*}" ] && echo "$pid"
}
