// The settings panel: the system prompt, the sampler and its parameters, temperature, seed,
// max tokens and the modifiers, built from the server's table of samplers; the spec they
// make is shown at the top of the page.

import { el } from "./markdown.js";
import { $, DEFAULTS, persist, spec, state } from "./page.js";

function field(labelText, input, help) {
  const label = el("label", "field");
  label.append(el("span", "label", labelText), input);
  if (help) label.title = help;
  return label;
}

function numberInput(value, placeholder, onInput, step = "any") {
  const input = el("input");
  input.type = "text";
  input.inputMode = "decimal";
  input.value = value ?? "";
  input.placeholder = placeholder ?? "";
  input.dataset.step = step;
  input.addEventListener("input", () => onInput(input.value.trim()));
  return input;
}

function choiceInput(value, param, onInput) {
  const select = el("select");
  const choices = ["", ...param.choices];
  select.replaceChildren(...choices.map((choice) => {
    const option = el("option", "", choice || `${param.default} (default)`);
    option.value = choice;
    return option;
  }));
  select.value = choices.includes(value) ? value : "";
  select.addEventListener("change", () => onInput(select.value));
  return select;
}

function paramInputs(sampler, values, onChange) {
  return sampler.params.map((param) => {
    const set = (value) => {
      values[param.name] = value;
      onChange();
    };
    const input = param.choices.length ? choiceInput(values[param.name], param, set)
      : numberInput(values[param.name], String(param.default), set);
    input.name = `${sampler.name}.${param.name}`;
    return field(param.name, input, `${param.help}; ${param.range}`);
  });
}

export function buildSettings() {
  const s = state.settings;
  const samplers = state.table.filter((t) => !t.modifier);
  const select = $("sampler");
  select.replaceChildren(...samplers.map((t) => {
    const option = el("option", "", t.name);
    option.value = t.name;
    option.title = t.summary;
    return option;
  }));
  select.value = samplers.some((t) => t.name === s.sampler) ? s.sampler : "adaptive";
  s.sampler = select.value;
  const chosen = samplers.find((t) => t.name === s.sampler);
  const params = (s.params[s.sampler] ||= {});
  $("sampler-params").replaceChildren(...(chosen ? paramInputs(chosen, params, changed) : []));
  $("temperature").value = s.temperature ?? "";
  $("temperature").disabled = !chosen?.takes_temp;
  $("seed").value = s.seed ?? "";
  $("max-tokens").value = s.maxTokens ?? "";
  $("modifiers").replaceChildren(...state.table.filter((t) => t.modifier).map((t) => {
    const entry = (s.modifiers[t.name] ||= { on: false, params: {} });
    const box = el("fieldset", "modifier");
    const legend = box.appendChild(el("legend"));
    const label = legend.appendChild(el("label"));  // the switch is named by its modifier
    const toggle = label.appendChild(el("input"));
    toggle.type = "checkbox";
    toggle.name = `${t.name}.on`;
    toggle.checked = entry.on;
    toggle.addEventListener("change", () => {
      entry.on = toggle.checked;
      changed();
    });
    label.append(` ${t.name}`);
    legend.title = t.summary;
    box.append(...paramInputs(t, entry.params, changed));
    return box;
  }));
  changed();
}

function changed() {
  $("spec").textContent = spec();
  $("spec-preview").textContent = spec();
  persist();
}

export function wireSettings() {
  $("sampler").addEventListener("change", () => {
    state.settings.sampler = $("sampler").value;
    buildSettings();
  });
  const bind = (id, key) => $(id).addEventListener("input", () => {
    state.settings[key] = $(id).value.trim();
    changed();
  });
  bind("temperature", "temperature");
  bind("seed", "seed");
  bind("max-tokens", "maxTokens");
  $("system").addEventListener("input", () => {
    state.settings.system = $("system").value;
    if (state.chat) state.chat.system = $("system").value;
    persist();
  });
  $("reset-settings").addEventListener("click", () => {
    Object.assign(state.settings, { ...DEFAULTS, model: state.settings.model,
      theme: state.settings.theme, tokenView: state.settings.tokenView, params: {}, modifiers: {} });
    buildSettings();
  });
  $("open-settings").addEventListener("click", () => showSettings($("settings").hidden));
  $("close-settings").addEventListener("click", () => showSettings(false));
}

// The settings panel opened (focus on its first field) or closed (focus back on its button).
export function showSettings(open) {
  $("settings").hidden = !open;
  $("open-settings").setAttribute("aria-expanded", String(open));
  (open ? $("system") : $("open-settings")).focus();
}
