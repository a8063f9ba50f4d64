"""The benchmarks' shared harness: recording a result (record), the generated headline table of bench/RESULTS.md
(headline), starting scratch servers and runs (runs), and measuring CPU (cpu, proc_cpu)."""
