# Nsight Compute on bench/gluon_probe.py's two forms at M = 64 on qkv (queued for the next GPU session,
# bench/KERNELS_NOTES.md item 53): stall reasons per issued instruction, above all membar (does the
# fence before each wgmma wait for the cp.async copies in flight?), long scoreboard and barrier.
# From the repository root on a GPU machine.
export PYTHONPATH=.
M="smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum"
for label in "(64, 5, 1, 64, True, True)" "tma(64, 4, 64, True)"; do
  ncu --kernel-name regex:gluon_w4_gemm --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
      --section SchedulerStats --section WarpStateStats --metrics $M \
      python bench/gluon_probe.py --launch "$label" --shape qkv --ms 64 2>&1 | grep -v "^==PROF=="
done
