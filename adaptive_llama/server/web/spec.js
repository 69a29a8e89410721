// The sampler settings as a spec, NAME[:key=value,...][+MODIFIER[:key=value,...]]..., the
// text the server's `sampler` field, the CLI and the REPL's /save file take, and back.
//
// settings: {sampler, params: {sampler: {key: value}}, modifiers: {name: {on, params}},
// temperature}; a parameter left empty takes the server's default.

export function specOf(settings, table) {
  const byName = Object.fromEntries(table.map((s) => [s.name, s]));
  const sampler = byName[settings.sampler] ? settings.sampler : "adaptive";
  const values = { ...(settings.params?.[sampler] || {}) };
  if (byName[sampler]?.takes_temp && settings.temperature !== "" && settings.temperature != null) {
    values.temp = settings.temperature;
  }
  const parts = [entry(sampler, values)];
  for (const s of table) {
    const modifier = settings.modifiers?.[s.name];
    if (s.modifier && modifier?.on) parts.push(entry(s.name, modifier.params || {}));
  }
  return parts.join("+");
}

function entry(name, values) {
  const given = Object.entries(values).filter(([, v]) => v !== "" && v != null);
  return given.length ? `${name}:${given.map(([k, v]) => `${k}=${v}`).join(",")}` : name;
}

// The settings a spec stands for (unknown names are kept, for the server to refuse).
export function parseSpec(text, table) {
  const modifiers = new Set(table.filter((s) => s.modifier).map((s) => s.name));
  const settings = { sampler: "adaptive", params: {}, modifiers: {}, temperature: "" };
  for (const part of text.split("+")) {
    const [rawName, rest = ""] = part.split(/:(.*)/s);
    const name = rawName.trim().toLowerCase();
    const values = {};
    for (const pair of rest.split(",").filter((p) => p.trim())) {
      const [key, value = ""] = pair.split("=");
      values[key.trim()] = value.trim();
    }
    if (modifiers.has(name)) {
      settings.modifiers[name] = { on: true, params: values };
    } else {
      settings.sampler = name;
      if ("temp" in values) {
        settings.temperature = values.temp;
        delete values.temp;
      }
      settings.params[name] = values;
    }
  }
  return settings;
}
