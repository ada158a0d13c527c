#!/usr/bin/env python3
"""Every .cu file of kernels/ with a __global__ kernel has a module anchor
(kernels/internal/kernel_modules.h) that kernels/kernel_preload.cc's
StepKernelModules lists, so PreloadStepKernels loads its kernels before the
first step (kernels/kernel_preload.h). A new kernel file without one fails
here, where the GPU test could not see it (it checks the list it loads)."""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parents[2]
header = (root / "kernels/internal/kernel_modules.h").read_text()
preload = (root / "kernels/kernel_preload.cc").read_text()
declared = set(re.findall(r"const void\* (\w+Module)\(\);", header))
listed_block = preload[preload.index("StepKernelModules() {"):]
listed_block = listed_block[:listed_block.index("};")]
listed = set(re.findall(r"internal::(\w+Module)\(\)", listed_block))
errors = []
for cu in sorted((root / "kernels").rglob("*.cu")):
    text = cu.read_text()
    if "__global__" not in text:
        continue
    defined = re.findall(r"const void\* (?:internal::|::moe_ep::kernels::internal::)?(\w+Module)\(\)", text)
    rel = cu.relative_to(root)
    if not defined:
        errors.append(f"{rel}: has __global__ kernels but defines no *Module() anchor")
        continue
    for name in defined:
        if name not in declared:
            errors.append(f"{rel}: anchor {name} is not declared in kernels/internal/kernel_modules.h")
        if name not in listed:
            errors.append(f"{rel}: anchor {name} is not in StepKernelModules() (kernels/kernel_preload.cc)")
for name in sorted(declared - listed):
    errors.append(f"kernels/internal/kernel_modules.h: {name} is declared but not listed")
if len(listed) < 10:
    errors.append(f"StepKernelModules() lists {len(listed)} anchors; expected the 17 kernel files")
for e in errors:
    print(e)
print(f"{len(listed)} anchors listed, {len(errors)} problems")
sys.exit(1 if errors else 0)
