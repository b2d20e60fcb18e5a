# Nsight Compute on two configurations of the Gluon GEMM (quantkit/kernels/gluon_gemm.py) at M = 64 on
# qkv, through bench/gluon_probe.py --launch: stall reasons per issued instruction, occupancy, DRAM
# throughput. Run 53 (bench/results/ncu_gluon_run53.txt, the probe's earlier forms) found no proxy-fence
# stalls; fixed-latency dependencies and global loads dominate (bench/KERNELS_NOTES.md item 54).
# From the repository root on a GPU machine.
export PYTHONPATH=.
M="smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum"
for label in "gg(64, 4, 64, 1)" "gg(32, 6, 64, 1)"; do
  ncu --kernel-name regex:w4_gemm_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
      --section SchedulerStats --section WarpStateStats --metrics $M \
      python bench/gluon_probe.py --launch "$label" --shape qkv --ms 64 2>&1 | grep -v "^==PROF=="
done
