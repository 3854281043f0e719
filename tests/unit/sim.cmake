# SPDX-License-Identifier: Apache-2.0
# engine-sim's pure modules: the prefix cache behind its KV events.
px_unit_test(sim_prefix simcore)
