"""The CPU kernels and their Python entry points: C++ sources in csrc/, built per machine
(cpu_kernels.py), and the ops that call them with torch fallbacks (attention, layer ops,
matmuls)."""
