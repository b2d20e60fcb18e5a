# Nsight Compute on configurations of the Gluon GEMM (quantkit/kernels/gluon_gemm.py), through
# bench/probes/gluon_probe.py --launch: stall reasons per issued instruction, occupancy, DRAM and L2 throughput.
#   bash bench/probes/gluon_profile.sh [SHAPE] [M] [LABEL ...]     # default: qkv, M = 256, BM 128 with 64 and 128 rows
# Run 53 (bench/results/ncu_gluon_run53.txt, qkv M = 64, the probe's earlier forms) found no proxy-fence
# stalls; fixed-latency dependencies and global loads dominate (bench/KERNELS_NOTES.md item 54). Queued
# (item 66's next step 1): whether L2 throughput limits M = 256, where each 64-row program reads its
# whole x tile. From the repository root on a GPU machine.
export PYTHONPATH=.
M="smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum"
shape=${1:-qkv}
m=${2:-256}
shift $(( $# < 2 ? $# : 2 ))
labels=("$@")
[ ${#labels[@]} -eq 0 ] && labels=("gg(128, 3, 64, 1)" "gg(128, 4, 128, 1)")
M="$M,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum.per_second,l1tex__m_xbar2l1tex_read_bytes.sum"
for label in "${labels[@]}"; do
  ncu --kernel-name regex:gemm_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
      --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis --metrics $M \
      python bench/probes/gluon_probe.py --launch "$label" --shape "$shape" --ms "$m" 2>&1 | grep -v "^==PROF=="
done
