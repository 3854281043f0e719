// SPDX-License-Identifier: Apache-2.0
// Validates rendered Kubernetes objects against the API's OpenAPI schemas
// (npm kubernetes-models: generated from Kubernetes' own OpenAPI spec, and
// @kubernetes-models/prometheus-operator from the Prometheus Operator's CRDs,
// @kubernetes-models/keda from KEDA's;
// validated with ajv; no cluster needed).  Catches wrong types, missing
// required fields and bad enum values; unknown fields are not reported.
//
//   node validate.mjs objects.json...     (each file: a JSON array of objects)
// deploy/check.sh copies it beside an `npm ci` of package.json here, so
// that kubernetes-models resolves from the node_modules next to it.
import { readFileSync } from "node:fs";

let bad = 0, ok = 0;
for (const file of process.argv.slice(2)) {
  for (const d of JSON.parse(readFileSync(file, "utf8"))) {
    const where = `${file.replace(/.*\//, "")}: ${d.kind}/${d.metadata && d.metadata.name}`;
    const [group, version] = d.apiVersion.includes("/") ? d.apiVersion.split("/") : ["", d.apiVersion];
    let Cls;
    try {
      // The Prometheus Operator's CRDs (ServiceMonitor, PodMonitor) come
      // from their own package, generated from the CRDs' OpenAPI schemas.
      // KEDA's ScaledObject from KEDA's CRDs, likewise.
      const pkg = group === "monitoring.coreos.com" ? "@kubernetes-models/prometheus-operator"
        : group === "keda.sh" ? "@kubernetes-models/keda" : "kubernetes-models";
      const mod = await import(`${pkg}/${group ? group + "/" : ""}${version}/${d.kind}`);
      Cls = mod[d.kind];
      if (!Cls) throw new Error("module has no export " + d.kind);
    } catch (e) {
      console.log(`deploy/check: FAIL: ${where}: no schema for ${d.apiVersion} ${d.kind} (${e.message})`);
      bad++;
      continue;
    }
    try {
      new Cls(d).validate();
      ok++;
    } catch (e) {
      console.log(`deploy/check: FAIL: ${where}: ${e.message}`);
      bad++;
    }
  }
}
console.log(`   schema: ${ok} objects valid, ${bad} invalid`);
process.exit(bad ? 1 : 0);
